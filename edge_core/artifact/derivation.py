"""The one derivation edge replicates from a configuration class: the layer pattern, evaluated in a sandbox.

transformers 5.x configuration classes write ``if self.layer_types is None:
self.layer_types = <expression>`` in ``__post_init__`` (4.x: in ``__init__``),
from the layer count and a pattern
(Gemma3TextConfig: every sliding_window_pattern-th layer full, pattern from
kwargs.get("sliding_window_pattern", 6)). Heads, KV heads and head_dim
derivations (`num_key_value_heads = num_attention_heads`, `head_dim = hidden
// heads`) are not replicated: the KV arithmetic applies the same rules to a
field left unset. The guard's statements are evaluated over a whitelist --
literals, the config's fields, kwargs.get/pop with literal defaults,
arithmetic, comparisons, conditional expressions, bool/int/len/min/max/range,
list literals and comprehensions, sizes bounded -- so nothing is executed;
anything else, or a second place that assigns the field, leaves it unfilled.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from .config_class import NO_VALUE, ConfigSource, self_assignments
from .fields import LAYER_COUNT_FIELDS

#: Fields edge derives as the class's code would (see above).
DERIVED_FIELDS = ("layer_types",)
#: The longest list, string or range a derivation may build (layer counts are in the hundreds).
MAX_DERIVED_ITEMS = 1 << 16


class _Unevaluable(Exception):
    """The derivation uses code outside edge's whitelist; the field stays unfilled."""


_UNKNOWN = object()
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_CALLS: dict[str, Callable[..., Any]] = {"bool": bool, "int": int, "len": len, "min": min, "max": max, "abs": abs,
                                         "range": range, "list": list}


def derive_field(source: ConfigSource, name: str, text: dict[str, Any]) -> Any:
    """``name`` as the class's unset-guard derivation computes it from ``text``; None when edge cannot say.

    Exactly one ``if self.<name> is None:`` guard among the class's
    ``__init__`` / ``__post_init__`` bodies, and no other code assigning
    ``name``; the statements before it are followed as far as the whitelist
    reaches (anything they assign otherwise becomes unknown). A layer list
    must have one string per layer of the config.
    """
    guards = [(params, body, i) for params, body in source.bodies for i, stmt in enumerate(body)
              if _is_unset_guard(stmt, name)]
    if len(guards) != 1:
        return None
    params, body, index = guards[0]
    guard = body[index]
    assert isinstance(guard, ast.If)
    if source.assigned.get("*", 0) or source.assigned.get(name, 0) != self_assignments(guard).get(name, 0):
        return None
    # Code outside the guard's body runs before it only through a call in the
    # body's prefix (followed as opaque); a guard in a base's body also runs
    # after the subclass's code, so what any other body assigns is unknown there.
    body_sites = self_assignments(ast.Module(body=list(body), type_ignores=[]))
    unknowable = set(source.opaque)
    if guards[0][1] is not source.bodies[0][1]:
        unknowable |= {attr for attr, n in source.assigned.items() if n > body_sites.get(attr, 0)}
    scope = _Derivation(source, text, params, frozenset(unknowable))
    try:
        for stmt in body[:index]:
            scope.follow(stmt)
        for stmt in guard.body:
            scope.run(stmt)
        value = scope.env.get(f"self.{name}")
    except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError, RecursionError, MemoryError):
        return None
    layers = next((text[n] for n in LAYER_COUNT_FIELDS if text.get(n) is not None), None)
    if name == "layer_types" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)
                                      and len(value) == layers):
        return None
    return value


def _is_unset_guard(stmt: ast.stmt, name: str) -> bool:
    test = stmt.test if isinstance(stmt, ast.If) else None
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is)
            and _is_self_attribute(test.left, name) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None)


def _is_self_attribute(node: ast.expr, name: str | None = None) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and (name is None or node.attr == name))


class _Derivation:
    """The state a derivation reads: locals and ``self.<attr>`` assigned so far, the config, the class defaults."""

    def __init__(self, source: ConfigSource, text: dict[str, Any], params: dict[str, Any],
                 unknowable: frozenset[str]) -> None:
        self.source, self.text, self.unknowable = source, text, unknowable
        self.published = {source.attribute_map.get(k, k): v for k, v in text.items()}
        # 4.x __init__: a parameter holds the published value, else its literal default.
        self.env: dict[str, Any] = {p: text[p] if p in text else (_UNKNOWN if d is NO_VALUE else d)
                                    for p, d in params.items()}
        self.declared = source.fields | set(params)

    def follow(self, stmt: ast.stmt) -> None:
        """A statement before the guard, followed as far as the whitelist reaches.

        A simple assignment is evaluated, an ``if`` whose test evaluates follows
        its branch (Exaone4: ``if self.sliding_window is None:
        self.sliding_window_pattern = 0``); anything else makes what it assigns unknown.
        """
        key = _assignment_key(stmt)
        if key is not None and isinstance(stmt, ast.Assign):
            try:
                self.env[key] = self.eval(stmt.value, {})
            except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError):
                self.env[key] = _UNKNOWN
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return
        if isinstance(stmt, ast.If):
            try:
                taken = self.eval(stmt.test, {})
            except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError):
                taken = _UNKNOWN
            if taken is not _UNKNOWN:
                for inner in stmt.body if taken else stmt.orelse:
                    self.follow(inner)
                return
        # A call edge cannot follow (a method, super().__post_init__) may assign anything the class assigns.
        opaque = any(isinstance(node, ast.Call) and not self._whitelisted(node) for node in ast.walk(stmt))
        for attr in self.source.assigned if opaque else self_assignments(stmt):
            self.env[f"self.{attr}"] = _UNKNOWN
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.env[node.id] = _UNKNOWN

    def run(self, stmt: ast.stmt) -> None:
        """A statement inside the guard: only simple assignments (and docstrings) are allowed."""
        key = _assignment_key(stmt)
        if key is not None and isinstance(stmt, ast.Assign):
            self.env[key] = self.eval(stmt.value, {})
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            raise _Unevaluable(type(stmt).__name__)

    def self_value(self, attr: str) -> Any:
        """``self.<attr>`` at this point: as assigned before the guard, else published, else the literal default."""
        canonical = self.source.attribute_map.get(attr, attr)
        if attr in self.unknowable or canonical in self.unknowable:
            raise _Unevaluable(f"self.{attr}")
        for key in (f"self.{attr}", f"self.{canonical}"):
            if key in self.env:
                return self._known(self.env[key])
        if canonical in self.published:
            return self.published[canonical]
        if canonical not in self.source.defaults:
            raise _Unevaluable(f"self.{attr}")
        return self.source.defaults[canonical]

    def _whitelisted(self, node: ast.Call) -> bool:
        func = node.func
        if isinstance(func, ast.Name):
            return func.id in _CALLS
        return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "kwargs"
                and func.attr in ("get", "pop"))

    @staticmethod
    def _known(value: Any) -> Any:
        if value is _UNKNOWN:
            raise _Unevaluable("a value the code before the guard computed")
        return value

    @staticmethod
    def _sized(value: Any) -> Any:
        if isinstance(value, (list, tuple, str, range)) and len(value) > MAX_DERIVED_ITEMS:
            raise _Unevaluable(f"a sequence longer than {MAX_DERIVED_ITEMS}")
        return value

    def eval(self, node: ast.expr, names: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            if node.value is None or isinstance(node.value, (bool, int, float, str)):
                return node.value
        elif isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            if node.id in self.env:
                return self._known(self.env[node.id])
        elif isinstance(node, ast.Attribute) and _is_self_attribute(node):
            return self.self_value(node.attr)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._binary(node, names)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            value = self.eval(node.operand, names)
            if isinstance(node.op, ast.Not):
                return not value
            if not isinstance(value, (int, float)):
                raise _Unevaluable("a sign on a non-number")
            return -value if isinstance(node.op, ast.USub) else value
        elif isinstance(node, ast.BoolOp):
            result: Any = None
            for operand in node.values:
                result = self.eval(operand, names)
                if bool(result) == isinstance(node.op, ast.Or):
                    return result
            return result
        elif isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = self.eval(node.left, names)
            for op, comparator in zip(node.ops, node.comparators):
                right = self.eval(comparator, names)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        elif isinstance(node, ast.IfExp):
            return self.eval(node.body if self.eval(node.test, names) else node.orelse, names)
        elif isinstance(node, ast.Call) and self._whitelisted(node) and not node.keywords:
            return self._call(node, names)
        elif isinstance(node, (ast.List, ast.Tuple)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            items = [self.eval(e, names) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            container, index = self.eval(node.value, names), self.eval(node.slice, names)
            if isinstance(container, (list, tuple, dict, str)):
                return container[index]
        elif isinstance(node, ast.ListComp):
            out: list[Any] = []
            self._comprehend(node.elt, node.generators, names, out)
            return out
        raise _Unevaluable(type(node).__name__)

    def _binary(self, node: ast.BinOp, names: dict[str, Any]) -> Any:
        left, right = self.eval(node.left, names), self.eval(node.right, names)
        numbers = (int, float)
        if isinstance(left, numbers) and isinstance(right, numbers):
            return _BINARY[type(node.op)](left, right)
        if isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, (list, str)):
            return self._sized(left + right)
        if isinstance(node.op, ast.Mult) and isinstance(left, (list, str)) and type(right) is int:
            left, right = right, left
        if isinstance(node.op, ast.Mult) and type(left) is int and isinstance(right, (list, str)):
            if left * len(right) > MAX_DERIVED_ITEMS:
                raise _Unevaluable(f"a sequence longer than {MAX_DERIVED_ITEMS}")
            return left * right
        raise _Unevaluable(f"{type(node.op).__name__} on {type(left).__name__} and {type(right).__name__}")

    def _call(self, node: ast.Call, names: dict[str, Any]) -> Any:
        func = node.func
        if isinstance(func, ast.Attribute):  # kwargs.get / kwargs.pop: a published field the class does not declare
            if not 1 <= len(node.args) <= 2 or not isinstance(node.args[0], ast.Constant):
                raise _Unevaluable("kwargs lookup")
            key = node.args[0].value
            if isinstance(key, str) and key in self.text and key not in self.declared:
                return self.text[key]
            return self.eval(node.args[1], names) if len(node.args) == 2 else None
        assert isinstance(func, ast.Name)
        args = [self._sized(self.eval(arg, names)) for arg in node.args]
        if func.id == "range" and not all(type(a) is int for a in args):
            raise _Unevaluable("range over a non-integer")
        if func.id == "int" and not all(isinstance(a, (bool, int, float)) for a in args):
            raise _Unevaluable("int of a non-number")
        return self._sized(_CALLS[func.id](*args))

    def _comprehend(self, elt: ast.expr, generators: list[ast.comprehension], names: dict[str, Any],
                    out: list[Any]) -> None:
        if not generators:
            out.append(self.eval(elt, names))
            if len(out) > MAX_DERIVED_ITEMS:
                raise _Unevaluable(f"a list longer than {MAX_DERIVED_ITEMS}")
            return
        first = generators[0]
        if first.is_async or not isinstance(first.target, ast.Name):
            raise _Unevaluable("comprehension target")
        iterable = self._sized(self.eval(first.iter, names))
        if not isinstance(iterable, (list, tuple, range, str)):
            raise _Unevaluable("iteration over a non-sequence")
        for item in iterable:
            scope = {**names, first.target.id: item}
            if all(self.eval(condition, scope) for condition in first.ifs):
                self._comprehend(elt, generators[1:], scope, out)


def _assignment_key(stmt: ast.stmt) -> str | None:
    """``"name"`` or ``"self.attr"`` for a one-target assignment, else None."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        return target.id
    return f"self.{target.attr}" if _is_self_attribute(target) and isinstance(target, ast.Attribute) else None
