"""What a transformers configuration class's source declares, read with ``ast``; nothing executed.

:func:`class_source` reads one class and merges its bases: each field's
literal default, the places its methods assign a field otherwise, its
``attribute_map`` and ``sub_configs``, and the ``__init__`` /
``__post_init__`` bodies a derivation (:mod:`.derivation`) follows.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..services.source_tree import SourceTree

#: The base every configuration class ends at; its own fields (dtype, labels) are not geometry.
_ROOT_CONFIGS = frozenset({"PreTrainedConfig", "PretrainedConfig"})
#: How deep a chain of configuration base classes edge follows (transformers' own deepest is 2).
MAX_BASE_DEPTH = 8
#: transformers' per-layer overrides (HeterogeneousConfigMixin): a class or config using them is not filled.
PER_LAYER_CONFIG = "per_layer_config"


class NotReadable(Exception):
    """Why transformers' source gave no class to read defaults from (the manifest's source line says it)."""


@dataclass(frozen=True)
class ConfigSource:
    """What a configuration class's source says, read with :mod:`ast`; nothing of it was executed.

    ``defaults`` holds each field's literal default (class-level annotated
    fields in transformers 5.x, ``__init__`` keywords passed through to
    ``self.<name>`` in 4.x); ``assigned`` counts the places its methods assign
    ``self.<name>`` otherwise (``"*"``: a ``setattr`` with a computed name), so
    such a default is not final. ``bodies`` are the ``__init__`` /
    ``__post_init__`` bodies, most-derived class first, each with its keyword
    defaults; ``sub_configs`` maps a wrapper's sub-config key to the (file,
    class) it names. ``per_layer``: its code builds a ``per_layer_config``
    (Gemma4TextConfig: full-attention layers get their own head_dim), so no
    one value of a geometry field describes every layer. ``opaque``: names
    whose value no code edge follows gives (properties, plain class attributes
    over a field).
    """

    name: str
    files: tuple[str, ...]
    defaults: dict[str, Any]
    fields: frozenset[str]
    attribute_map: dict[str, str]
    assigned: dict[str, int]
    bodies: tuple[tuple[dict[str, Any], tuple[ast.stmt, ...]], ...]
    sub_configs: dict[str, tuple[str, str]]
    per_layer: bool = False
    opaque: frozenset[str] = frozenset()

    def computed(self, name: str) -> bool:
        """Whether code of the class may give ``name`` another value than its declared default."""
        return self.assigned.get(name, 0) > 0 or self.assigned.get("*", 0) > 0


#: Classes read per (package, version, file, class): a process reads each source once.
_CLASSES: dict[tuple[str, str | None, str, str], ConfigSource] = {}


def dotted_tail(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def import_target(reader: SourceTree, rel: str, stmt: ast.ImportFrom) -> str | None:
    """The package-relative file a relative ``from ... import`` reads (None: outside the package or absent)."""
    if not stmt.module or not stmt.level:
        return None
    base = os.path.dirname(rel)
    for _ in range(stmt.level - 1):
        if not base:
            return None
        base = os.path.dirname(base)
    target = os.path.normpath(os.path.join(base, *stmt.module.split(".")))
    if target.startswith("..") or os.path.isabs(target):
        return None
    for candidate in (f"{target}.py", os.path.join(target, "__init__.py")):
        if reader.exists(candidate):
            return candidate.replace(os.sep, "/")
    return None


def class_source(reader: SourceTree, rel: str, name: str, depth: int = 0) -> ConfigSource:
    """What configuration class ``name`` in file ``rel`` declares, its bases' declarations merged in."""
    key = (str(reader.root), reader.version, rel, name)
    if key in _CLASSES:
        return _CLASSES[key]
    if depth > MAX_BASE_DEPTH:
        raise NotReadable(f"{name}'s configuration base classes nest deeper than {MAX_BASE_DEPTH}")
    tree = reader.module(rel)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if name not in classes and rel.endswith("/__init__.py"):
        # `from ..siglip import SiglipVisionConfig`: a lazy package re-exports its configuration module.
        leaf = os.path.basename(os.path.dirname(rel))
        sibling = f"{os.path.dirname(rel)}/configuration_{leaf}.py"
        if reader.exists(sibling):
            return class_source(reader, sibling, name, depth)
    node = classes.get(name)
    if node is None:
        raise NotReadable(f"transformers {reader.version}'s {rel} defines no class {name}")
    imports: dict[str, tuple[str, str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (module := import_target(reader, rel, stmt)) is not None:
            imports.update({alias.asname or alias.name: (module, alias.name) for alias in stmt.names})

    def locate(expr: ast.expr) -> tuple[str, str] | None:
        if not isinstance(expr, ast.Name) or expr.id in _ROOT_CONFIGS:
            return None
        return (rel, expr.id) if expr.id in classes else imports.get(expr.id)

    # Bases edge cannot locate (mixins from outside transformers) add nothing.
    bases = [class_source(reader, *where, depth + 1) for where in map(locate, node.bases) if where is not None]
    found = _Declarations()
    for base in reversed(bases):  # the leftmost base wins, as in the MRO of these flat hierarchies
        found.inherit(base)
    for stmt in node.body:
        found.read(stmt, locate)
    source = ConfigSource(
        name=name,
        files=tuple(dict.fromkeys([rel, *(f for base in bases for f in base.files)])),
        defaults=found.defaults, fields=frozenset(found.fields), attribute_map=found.attribute_map,
        assigned=found.assigned, bodies=(*found.bodies, *(body for base in bases for body in base.bodies)),
        sub_configs=found.sub_configs, opaque=frozenset(found.opaque),
        per_layer=any(base.per_layer for base in bases) or any(
            dotted_tail(n) == PER_LAYER_CONFIG or (isinstance(n, ast.Constant) and n.value == PER_LAYER_CONFIG)
            for stmt in node.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(stmt) if isinstance(n, ast.expr)))
    _CLASSES[key] = source
    return source


class _Declarations:
    """What a class body and its bases declare, gathered statement by statement into a :class:`ConfigSource`."""

    def __init__(self) -> None:
        self.defaults: dict[str, Any] = {}
        self.fields: set[str] = set()
        self.assigned: dict[str, int] = {}
        self.attribute_map: dict[str, str] = {}
        self.sub_configs: dict[str, tuple[str, str]] = {}
        self.opaque: set[str] = set()
        self.bodies: list[tuple[dict[str, Any], tuple[ast.stmt, ...]]] = []

    def inherit(self, base: ConfigSource) -> None:
        self.defaults.update(base.defaults)
        self.fields |= base.fields
        self.add_sites(base.assigned)
        self.attribute_map = base.attribute_map or self.attribute_map
        self.sub_configs.update(base.sub_configs)
        self.opaque |= base.opaque

    def add_sites(self, sites: dict[str, int]) -> None:
        for attr, n in sites.items():
            self.assigned[attr] = self.assigned.get(attr, 0) + n

    def class_attribute(self, attr: str, value: ast.expr | None,
                        locate: Callable[[ast.expr], tuple[str, str] | None]) -> None:
        self.attribute_map, self.sub_configs = _class_attribute(attr, value, self.attribute_map,
                                                                self.sub_configs, locate)

    def read(self, stmt: ast.stmt, locate: Callable[[ast.expr], tuple[str, str] | None]) -> None:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            declared = stmt.target.id
            annotation = stmt.annotation.value if isinstance(stmt.annotation, ast.Subscript) else stmt.annotation
            if dotted_tail(annotation) == "ClassVar":
                self.class_attribute(declared, stmt.value, locate)
                return
            self.fields.add(declared)
            self.defaults.pop(declared, None)
            literal = _literal(stmt.value) if stmt.value is not None else NO_VALUE
            if literal is not NO_VALUE:
                self.defaults[declared] = literal
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    self.class_attribute(target.id, stmt.value, locate)
                    if target.id in self.fields:  # a plain class attribute over an inherited field: not its default
                        self.defaults.pop(target.id, None)
                        self.add_sites({target.id: 1})
                        self.opaque.add(target.id)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.method(stmt)

    def method(self, stmt: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if any(dotted_tail(d) in ("property", "cached_property", "setter") for d in stmt.decorator_list):
            self.add_sites({stmt.name: 1})
            self.opaque.add(stmt.name)
        sites = self_assignments(stmt)
        params: dict[str, Any] = {}
        if stmt.name == "__init__":
            params = _keyword_defaults(stmt.args)
            for attr in _passed_through(stmt, params):  # `self.x = x`: how a 4.x field is set, not a derivation
                self.fields.add(attr)
                self.defaults.pop(attr, None)
                if params[attr] is not NO_VALUE:
                    self.defaults[attr] = params[attr]
                sites[attr] -= 1
            for local in _rebound_names(stmt) & set(params):  # `if x is None: x = ...` before `self.x = x`
                sites[local] = sites.get(local, 0) + 1
        self.add_sites(sites)
        if stmt.name in ("__init__", "__post_init__"):
            self.bodies.append((params, tuple(stmt.body)))


NO_VALUE = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NO_VALUE


def _class_attribute(attr: str, value: ast.expr | None, attribute_map: dict[str, str],
                     sub_configs: dict[str, tuple[str, str]],
                     locate: Callable[[ast.expr], tuple[str, str] | None],
                     ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``attribute_map`` (literal) and ``sub_configs`` (key -> class name) as a class body declares them."""
    if value is None:
        return attribute_map, sub_configs
    if attr == "attribute_map":
        literal = _literal(value)
        if isinstance(literal, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in literal.items()):
            return literal, sub_configs
    if attr == "sub_configs" and isinstance(value, ast.Dict):
        found: dict[str, tuple[str, str]] = {}
        for k, v in zip(value.keys, value.values):
            where = locate(v)
            if isinstance(k, ast.Constant) and isinstance(k.value, str) and where is not None:
                found[k.value] = where
        return attribute_map, found
    return attribute_map, sub_configs


def self_assignments(func: ast.AST) -> dict[str, int]:
    """attribute -> how many places ``func`` (a method or a statement) assigns or mutates ``self.<attribute>``.

    Mutation counts: ``self.layer_types[-1] = ...`` (Gemma4TextConfig) or
    ``self.layer_types.append(...)`` changes what a default or derivation gave.
    ``"*"``: a ``setattr`` with a computed name, which may assign anything.
    """
    sites: dict[str, int] = {}

    def add(attr: str) -> None:
        sites[attr] = sites.get(attr, 0) + 1

    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and dotted_tail(node.func) == "setattr" and len(node.args) >= 2:
            attr = node.args[1]
            add(attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else "*")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = _self_root(node.func.value)  # self.x.append(...), self.x[i].update(...)
            if owner is not None:
                add(owner)
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif (owner := _self_root(target)) is not None:
                add(owner)
    return sites


def _self_root(node: ast.expr) -> str | None:
    """``x`` for ``self.x``, ``self.x[i]``, ``self.x.y``: the attribute of self an expression reaches into."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        node = node.value
    return None


def _keyword_defaults(args: ast.arguments) -> dict[str, Any]:
    """``__init__``'s parameters -> literal default (``NO_VALUE``: none, or not a literal)."""
    params: dict[str, Any] = {arg.arg: NO_VALUE for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    params.pop("self", None)
    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        params[arg.arg] = _literal(default)
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        if kw_default is not None:
            params[arg.arg] = _literal(kw_default)
    return params


def _passed_through(func: ast.FunctionDef | ast.AsyncFunctionDef, params: dict[str, Any]) -> list[str]:
    return [stmt.targets[0].attr for stmt in func.body
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
            and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == "self"
            and isinstance(stmt.value, ast.Name) and stmt.value.id == stmt.targets[0].attr and stmt.value.id in params]


def _rebound_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names
