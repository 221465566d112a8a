"""edge-cpu's heap trim: vLLM CPU's worker gives its free heap back once the model is loaded (edge_cpu/_heap.py)."""

from __future__ import annotations

import ast
import ctypes
import importlib.metadata as metadata
import os
import sys
import textwrap
import types

import pytest

from edge_core.kit.vllm_source import SourceTree, class_def, installed_vllm
from edge_cpu import _heap


def fake_worker_module(calls: list[str]) -> types.ModuleType:
    module = types.ModuleType("fake_cpu_worker")

    class CPUWorker:
        def load_model(self, *args, **kwargs):
            calls.append(f"load{args}{sorted(kwargs.items())}")
            return "loaded"

    module.CPUWorker = CPUWorker
    return module


def test_the_worker_trims_its_heap_when_load_model_returns():
    calls: list[str] = []
    module = fake_worker_module(calls)
    assert _heap.wrap_worker(module, lambda: calls.append("trim") or True)
    assert module.CPUWorker().load_model(1, dummy=True) == "loaded"
    assert calls == ["load(1,)[('dummy', True)]", "trim"]


def test_wrapping_twice_trims_once():
    calls: list[str] = []
    module = fake_worker_module(calls)
    for _ in range(2):
        assert _heap.wrap_worker(module, lambda: calls.append("trim") or True)
    module.CPUWorker().load_model()
    assert calls == ["load()[]", "trim"]


def test_a_failed_load_still_trims_and_raises_its_own_error():
    calls: list[str] = []
    module = fake_worker_module(calls)

    def broken(self):
        raise RuntimeError("out of memory")

    module.CPUWorker.load_model = broken
    _heap.wrap_worker(module, lambda: calls.append("trim") or True)
    with pytest.raises(RuntimeError, match="out of memory"):
        module.CPUWorker().load_model()
    assert calls == ["trim"]


def test_a_module_without_the_worker_is_left_alone():
    assert not _heap.wrap_worker(types.ModuleType("elsewhere"), lambda: True)


def test_the_finder_wraps_the_worker_when_its_module_is_imported(tmp_path, monkeypatch):
    name = "edge_test_cpu_worker_module"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class CPUWorker:
            def load_model(self):
                return "loaded"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    trims: list[int] = []
    finder = _heap.WrapOnImport(name, lambda: trims.append(1) or True)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = __import__(name)
    assert finder not in sys.meta_path  # it steps aside once it has found the module
    assert module.CPUWorker().load_model() == "loaded" and trims == [1]
    sys.modules.pop(name, None)


def test_other_imports_pass_the_finder_by():
    finder = _heap.WrapOnImport("edge_test_never_imported", lambda: True)
    assert finder.find_spec("json", None) is None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_trim_gives_freed_heap_holes_back_to_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 2,000 blocks of 60 KiB (117 MiB), written to: under glibc's 128 KiB mmap threshold, so they come from
    # the main heap, as the packed weights' originals did.
    size = 60 << 10
    blocks = [libc.malloc(size) for _ in range(2000)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks[:-1]:  # the last stays in use, so the freed ones are a hole below it, not the heap's top
        libc.free(block)
    try:
        held = resident_bytes()
        assert _heap.trim() is True
        given_back = held - resident_bytes()
    finally:
        libc.free(blocks[-1])
    assert given_back > 100 << 20, given_back


def test_trim_after_load_installs_one_finder(monkeypatch):
    monkeypatch.setenv("EDGE_ENGINE", "1")  # an engine edge started (edge_cpu/_engine.py)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, _heap.WORKER_MODULE, raising=False)
    _heap.trim_after_load()
    _heap.trim_after_load()
    assert sum(isinstance(f, _heap.WrapOnImport) for f in sys.meta_path) == 1


def test_vllm_loads_it_as_a_general_plugin():
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("edge_cpu_heap") == "edge_cpu._heap:trim_after_load"


def test_the_installed_vllm_has_the_method_it_wraps():
    _, _, root = installed_vllm()
    if root is None:
        pytest.skip("no vLLM installed")
    tree = SourceTree(root)
    assert _heap.WORKER_MODULE == "vllm.v1.worker.cpu_worker"
    cls = class_def(tree.module("v1/worker/cpu_worker.py"), _heap.WORKER_CLASS)
    assert cls is not None
    if "load_model" not in methods_of(cls):  # inherited: CPUWorker(Worker), Worker from gpu_worker
        assert [ast.unparse(b) for b in cls.bases] == ["Worker"]
        base = class_def(tree.module("v1/worker/gpu_worker.py"), "Worker")
        assert base is not None and "load_model" in methods_of(base)


def methods_of(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
