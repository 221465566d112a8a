"""``edge_core.plan`` is pure: handed a read artifact, device facts and a ledger view, it reads nothing itself.

Issue 23: no network, no file reads, no environment, no registry import for
text. Two checks. Planning with files, sockets and the environment closed
gives the same plan as planning with them open (a seam the planner is handed,
such as a backend's hooks through the registry, may still do I/O: these plans
are made without one). And a scan of the source lists every place in
``plan/`` that could reach the disk, the network or the environment, which
must be exactly :data:`KNOWN_IO` — a new one fails until it is moved out or
listed here with why.
"""

from __future__ import annotations

import ast
import builtins
import io
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

from edge_core.artifact import read_manifest
from edge_core.devices import load_device_list
from edge_core.host import HostFacts
from edge_core.plan import plan_artifact
from edge_core.plan.parallel import ParallelRequest
from edge_core.plans import SessionSpec
from edge_core.services.host_ledger import LedgerView

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "edge_core" / "plan"
DATA = Path(__file__).parent / "data"

#: Modules whose import in plan/ means I/O (the network, processes, files, a graph parser that reads the file).
IO_MODULES = ("socket", "urllib", "http", "requests", "huggingface_hub", "subprocess", "shutil", "tempfile",
              "glob", "fcntl", "onnx", "onnxruntime", "edge_core.artifact.hub", "edge_core.artifact.hub_fetch")
#: Names that read the disk, the Hub or this machine, wherever they are imported from.
IO_NAMES = ("read_manifest", "resolve_model", "read_ledger", "admission", "discover", "install_hint",
            "load_device_list", "read_host", "download")
#: ``os`` attributes that touch the file system, the environment or the process.
OS_IO = ("environ", "getenv", "getpid", "getcwd", "stat", "lstat", "listdir", "scandir", "open", "walk",
         "path.exists", "path.lexists", "path.isfile", "path.isdir", "path.islink", "path.getsize",
         "path.getmtime", "path.realpath", "path.abspath", "path.samefile")
#: What services/ may lend plan/ at run time: a constant and a value type, never a function.
SERVICE_NAMES_AT_RUN_TIME = ("HOST_POOL", "LedgerView")

#: The I/O plan/ still does, with why it stays for now.
KNOWN_IO = sorted([
    # A device_committed remedy tells this process's own graph stages from other sessions' records.
    "committed.py: os.getpid",
])


def io_touches(root: Path = PLAN) -> list[str]:
    """``file: what`` for every import, call or attribute under ``root`` that could do I/O (sorted)."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(root).as_posix()
        type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith(IO_MODULES)]
            elif isinstance(node, ast.ImportFrom):
                module = (node.module or "") if node.level == 0 else f"edge_core.{node.module or ''}"
                if module.startswith(IO_MODULES):
                    found.append(f"{where}: from {module} import ...")
                found += [f"{where}: imports {a.name}" for a in node.names if a.name in IO_NAMES]
                if "services" in module.split(".") and id(node) not in type_checking:
                    found += [f"{where}: takes {a.name} from services at run time" for a in node.names
                              if a.name not in SERVICE_NAMES_AT_RUN_TIME]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open", "Path"):
                found.append(f"{where}: {node.func.id}()")
            elif isinstance(node, ast.Attribute):
                dotted = ast.unparse(node)
                if dotted.startswith("os.") and dotted[3:] in OS_IO:
                    found.append(f"{where}: {dotted}")
                elif node.attr in ("read_text", "read_bytes", "open") and not dotted.startswith("os."):
                    found.append(f"{where}: .{node.attr}()")
    return sorted(found)


def test_plan_does_only_the_known_io():
    assert io_touches() == KNOWN_IO


def test_the_scan_catches_a_read_a_hub_call_and_a_registry_import_for_text(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import os\nfrom ..artifact.hub import resolve_model\nfrom ..services.registry import install_hint\n"
        "def f(p):\n    return open(p).read(), os.environ.get('X'), os.path.isfile(p)\n")
    assert io_touches(tmp_path) == [
        "bad.py: from edge_core.artifact.hub import ...",
        "bad.py: imports install_hint",
        "bad.py: imports resolve_model",
        "bad.py: open()",
        "bad.py: os.environ",
        "bad.py: os.path.isfile",
        "bad.py: takes install_hint from services at run time",
    ]


# ---------------------------------------------------------------- planning with the world closed

@contextmanager
def closed_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Files, sockets and the environment refuse this thread (other threads, e.g. xdist's, pass through)."""
    me = threading.get_ident()
    touched: list[str] = []

    def guard(what: str, real):
        def refuse(*args, **kwargs):
            if threading.get_ident() != me:
                return real(*args, **kwargs)
            touched.append(f"{what}{args[:1]!r}")
            raise OSError(f"the planner touched {what}")
        return refuse

    class ClosedEnviron(dict):
        def __getitem__(self, key):
            touched.append(f"os.environ[{key!r}]")
            raise KeyError(key)

        def get(self, key, default=None):
            touched.append(f"os.environ.get({key!r})")
            return default

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"),
                         (os, "listdir"), (os, "scandir"), (socket, "socket"), (socket, "create_connection"),
                         (socket, "getaddrinfo")):
        monkeypatch.setattr(module, name, guard(f"{module.__name__}.{name}", getattr(module, name)))
    monkeypatch.setattr(os, "environ", ClosedEnviron())
    try:
        yield touched
    finally:
        monkeypatch.undo()


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
    root = tmp_path_factory.mktemp("llama70b")
    write_checkpoint(root, config, llama_like_tensors(config), shards=8)
    return root


@pytest.mark.parametrize("model,device_list,session,parallel", [
    ("llama8b", "devices-h100.json", {"max_model_len": 8192}, None),
    ("llama8b", "devices-cpu-32g.json", {"max_model_len": 131072}, None),
    ("llama70b", "devices-8xh100.json", {"max_model_len": 8192}, None),
    ("llama70b", "devices-8xh100.json", {"max_model_len": 8192}, ParallelRequest(tp=4, device_ids=("cuda:0", "cuda:1", "cuda:2", "cuda:3"))),
], ids=["one-gpu", "cpu-refused", "tp-search", "tp4-pinned"])
def test_planning_reads_nothing_itself(request, monkeypatch, model, device_list, session, parallel):
    manifest = read_manifest(str(request.getfixturevalue(model)))
    devices, host_doc = load_device_list(str(DATA / device_list))

    def plan():
        return plan_artifact(manifest, model=manifest.path, session=SessionSpec(**session), devices=devices,
                             host=HostFacts.from_dict(host_doc), devices_source=f"file:{device_list}",
                             ledger=LedgerView(), parallel=parallel).to_dict()

    open_world = plan()  # also imports whatever the planner imports lazily
    with closed_world(monkeypatch) as touched:
        closed = plan()
    assert touched == []
    assert closed == open_world
