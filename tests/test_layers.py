"""The layout keeps its one rule, and the cheap commands stay cheap.

The rule (README, docs/writing-a-backend.md): the top-level modules of
``edge_core`` are the contract backends import, and nothing else; each
sub-package is one tier, and imports point down only — ``kit/testing -> cli ->
runtime -> plan/page -> engines -> artifact -> services -> contract``. The import graph
is read from the source with ``ast``, and every import counts: one inside a
function (a cycle hidden in a function is still a cycle) and one under ``if
TYPE_CHECKING:`` (a type costs nothing at run time, but a cycle through it is
still a cycle, and a contract type living in a layer is not the contract).
``nox -s lint`` checks the tiers with import-linter too; this file also checks
what import-linter's layers contract does not: no cycle anywhere, no private
name crossing a module line, backends importing only documented paths — and,
in fresh interpreters, that ``edge devices``, ``edge plugins`` and ``edge
plan`` import no runtime.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edge_core"

#: Layer rank of each part of edge_core: a module may import only ranks <= its own.
LAYERS = {"edge_core.kit": 7, "edge_core.testing": 7, "edge_core.cli": 6, "edge_core.runtime": 5, "edge_core.plan": 4,
          "edge_core.page": 4, "edge_core.engines": 3, "edge_core.artifact": 2, "edge_core.services": 1}
#: The modules a backend may import (docs/writing-a-backend.md, "What you may import").
DOCUMENTED_FOR_BACKENDS = (
    "edge_core", "edge_core.hookspecs", "edge_core.devices", "edge_core.host", "edge_core.budget",
    "edge_core.stream", "edge_core.errors", "edge_core.routes", "edge_core.builds", "edge_core.server", "edge_core.plans",
    "edge_core.manifest", "edge_core.layout", "edge_core.plan", "edge_core.artifact", "edge_core.testing", "edge_core.kit.vllm_hooks", "edge_core.kit.ort_hooks",
    "edge_core.runtime.ort_stage", "edge_core.runtime.vllm_stage", "edge_core.kit.vllm_source",
)


def rank(module: str) -> int:
    if module == "edge_core" or module == "edge_core.__main__":
        return 8  # the package's public face and `python -m`: they may import anything, nothing imports them
    for layer, value in LAYERS.items():
        if module == layer or module.startswith(layer + "."):
            return value
    return 0  # a top-level contract module


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(imported module, names taken from it, line) for every import in ``path``, wherever it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, tuple[str, ...], int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((alias.name, (), child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = tuple(alias.name for alias in child.names)
                out.append((base, names, child.lineno))
            visit(child)

    visit(tree)
    return out


def edge_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the edge_core modules it imports (``from pkg import submodule`` resolves to the submodule)."""
    files = {module_name(p): p for p in root.rglob("*.py") if "demo" not in p.parts}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for target, names, _ in imports_of(path, module):
            if not target.startswith("edge_core"):
                continue
            hits = {f"{target}.{n}" for n in names if f"{target}.{n}" in files}
            if not hits and target in files:
                hits = {target}
            graph[module] |= hits - {module}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if rank(b) > rank(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def private_crossings(root: Path = PACKAGE, prefix: str = "edge_core") -> list[str]:
    """``from edge_core.x import _name`` anywhere under ``root`` (dunders such as ``__version__`` are public)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path) if path.is_relative_to(PACKAGE) else path.stem
        for target, names, line in imports_of(path, module):
            if target.startswith(prefix):
                out += [f"{path}:{line} takes {target}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    return out


# ---------------------------------------------------------------- the rule holds

def test_the_import_graph_has_no_cycle():
    assert cycles(edge_graph()) == []


def test_imports_point_down_only():
    assert upward_imports(edge_graph()) == []


def test_no_private_name_crosses_a_module_line():
    assert private_crossings() == []
    for backend in (*ROOT.glob("plugins/*/edge_*"), *ROOT.glob("examples/*/edge_*")):
        assert private_crossings(backend) == [], backend


def test_backends_import_only_documented_paths():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    used = set()
    for path in (*ROOT.glob("plugins/*/edge_*/**/*.py"), *ROOT.glob("examples/*/edge_*/**/*.py")):
        for target, names, line in imports_of(path, path.stem):
            if target.startswith("edge_core"):
                # `from edge_core.runtime import ort_stage` imports the submodule edge_core.runtime.ort_stage
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                for imported in submodules or [target]:
                    used.add((imported, f"{path.relative_to(ROOT)}:{line}"))
    undocumented = sorted(f"{where} imports {target}" for target, where in used
                          if target not in DOCUMENTED_FOR_BACKENDS)
    assert undocumented == []


def test_the_documented_paths_are_in_the_backend_guide():
    guide = (ROOT / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    missing = [m for m in DOCUMENTED_FOR_BACKENDS if m != "edge_core" and f"`{m}" not in guide]
    assert missing == []


# ---------------------------------------------------------------- the checks can fail

def test_the_checks_catch_a_cycle_an_upward_import_and_a_private_name(tmp_path):
    graph = {"edge_core.plan.a": {"edge_core.plan.b"}, "edge_core.plan.b": {"edge_core.plan.a"},
             "edge_core.artifact.x": {"edge_core.runtime.y"}, "edge_core.runtime.y": set()}
    assert cycles(graph) == [["edge_core.plan.a", "edge_core.plan.b"]]
    assert upward_imports(graph) == ["edge_core.artifact.x -> edge_core.runtime.y"]
    backend = tmp_path / "edge_bad"
    backend.mkdir()
    (backend / "__init__.py").write_text("def f():\n    from edge_core.runtime.vllm_stage import _reap\n")
    [crossing] = private_crossings(backend)
    assert crossing.endswith(":2 takes edge_core.runtime.vllm_stage._reap")


def test_imports_for_annotations_and_inside_functions_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edge_core.cli import x\n"
                      "def f():\n    from edge_core.runtime import y\n")
    targets = [t for t, _, _ in imports_of(source, "m")]
    assert "edge_core.runtime" in targets and "edge_core.cli" in targets


# ---------------------------------------------------------------- cheap commands stay cheap

#: Modules that must not be imported on a path. ``numpy``/``safetensors`` count for planning a checkpoint.
RUNTIMES = ("torch", "vllm", "transformers", "onnxruntime", "onnx")
CHEAP = [
    pytest.param(["devices", "--json"], RUNTIMES, id="edge devices"),
    pytest.param(["plugins", "--json"], RUNTIMES, id="edge plugins"),
    pytest.param(["plan", "--json"], (*RUNTIMES, "safetensors", "numpy"), id="edge plan"),
    pytest.param(None, (*RUNTIMES, "safetensors", "numpy"), id="import edge_core.runtime"),
]


@pytest.mark.parametrize("argv,forbidden", CHEAP)
def test_a_cheap_path_imports_no_runtime_in_a_fresh_interpreter(argv, forbidden, request):
    if argv == ["plan", "--json"]:
        request.getfixturevalue("demo_model")  # built once; planning the built demo model is the cheap path
    action = (f"with contextlib.redirect_stdout(io.StringIO()):\n    main({argv!r})\n" if argv is not None
              else "import edge_core.runtime, edge_core.artifact.graph\n")
    script = (
        "import sys, io, contextlib\n"
        "from edge_core.cli import main\n"
        f"{action}"
        f"print(','.join(m for m in {tuple(forbidden)!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
