"""Eager or compiled: the user's flag wins, else the owning backend's ``execution_mode``, else eager. In edge's
process or apart: the engine's rules for the layout (one unserved vLLM CPU rank runs in edge's process)."""

from __future__ import annotations

import pytest

from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.budget import combine
from edge_core.cli import build_parser
from edge_core.devices import Device
from edge_core.engines import vllm_launch
from edge_core.engines.vllm import VLLM_RULES
from edge_core.errors import UsageError
from edge_core.host import read_host
from edge_core.plan.execution import DEFAULT_REASON, execution_mode, with_mode, with_processes
from edge_core.plans import ExecutionMode, SessionSpec

GPU = Device.from_dict({"device_id": "acme:0", "kind": "gpu_discrete", "vendor": "acme", "name": "Acme",
                        "backend": "acme", "plugin": "acme", "runnable": True, "memory_pool": "vram",
                        "memory_bytes": 1 << 34})


class Owner:
    """The registry's owner dispatch, at the boundary: records each call and answers what the backend would."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def call_owner(self, device, hook, **kwargs):
        self.calls.append((device.device_id, hook, sorted(kwargs)))
        return self.answer


@pytest.fixture(scope="module")
def manifest():
    return read_manifest(str(DEMO_MODEL))


def test_the_backends_answer_decides_when_no_flag_is_given(manifest):
    owner = Owner(ExecutionMode(enforce_eager=False, source="default", reason="Acme compiles",
                                cudagraph_capture_sizes=(1, 2)))
    mode = execution_mode(GPU, manifest, SessionSpec(), owner, owned=True)
    assert (mode.enforce_eager, mode.source, mode.reason, mode.cudagraph_capture_sizes) == \
        (False, "backend", "Acme compiles", (1, 2))
    assert owner.calls == [("acme:0", "execution_mode", ["manifest", "session"])]


@pytest.mark.parametrize("flag, eager", [("--enforce-eager", True), ("--compile", False)])
def test_a_flag_overrides_the_backend_without_asking_it(manifest, flag, eager):
    owner = Owner(ExecutionMode(enforce_eager=not eager, source="backend", reason="the other way"))
    mode = execution_mode(GPU, manifest, SessionSpec(enforce_eager=eager), owner, owned=True)
    assert (mode.enforce_eager, mode.source) == (eager, flag) and flag in mode.reason
    assert owner.calls == []


def test_no_answer_or_a_backend_not_installed_here_is_eager(manifest):
    for owner, owned in ((Owner(None), True), (Owner("not a mode"), True), (Owner(ExecutionMode(
            enforce_eager=False, source="backend", reason="x")), False), (None, False)):
        mode = execution_mode(GPU, manifest, SessionSpec(), owner, owned=owned)
        assert (mode.enforce_eager, mode.source, mode.reason) == (True, "default", DEFAULT_REASON)


def test_with_mode_sets_enforce_eager_and_the_process_layout_and_nothing_else():
    session = SessionSpec(max_num_seqs=4)
    assert with_mode(session, None) is session
    assert with_mode(session, ExecutionMode(enforce_eager=False, source="backend", reason="r", in_process=True)) == \
        SessionSpec(max_num_seqs=4, enforce_eager=False, in_process=True)


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown execution source"):
        ExecutionMode(enforce_eager=True, source="guess", reason="r")


@pytest.mark.parametrize("command", ["plan", "run", "serve", "accept", "parity"])
def test_every_command_that_plans_takes_both_flags_and_defaults_to_the_backend(command):
    parser = build_parser()
    extra = ["--json", "out.json"] if command == "accept" else []
    assert parser.parse_args([command, *extra]).enforce_eager is None
    assert parser.parse_args([command, *extra, "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([command, *extra, "--compile"]).enforce_eager is False
    with pytest.raises((SystemExit, UsageError), match="not allowed with"):
        parser.parse_args([command, *extra, "--compile", "--enforce-eager"])


CPU = Device.from_dict({"device_id": "cpu", "kind": "cpu", "vendor": "amd", "name": "x", "backend": "vllm:cpu",
                        "plugin": "cpu", "runnable": True, "memory_pool": "host_ram", "memory_bytes": 1 << 35})


def test_one_unserved_cpu_rank_runs_in_edges_process_with_one_bound_thread_per_core(host_tree):
    host = read_host(host_tree(cores=4, allowed_cpus="0-2"))
    layout = VLLM_RULES.engine_processes(CPU, SessionSpec(), 1, host)
    assert layout.in_process and "uniprocess executor" in layout.reason
    # The variables vLLM's multiprocess executor sets for a worker it spawns (OMPProcessManager.configure_omp_envs),
    # on every usable CPU (no scheduler process needs one of its own), one thread pinned to each.
    assert dict(layout.env) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "3",
                                "OMP_PLACES": "{0},{1},{2}", "OMP_PROC_BIND": "close"}


@pytest.mark.parametrize("device,session,ranks,why", [
    (CPU, SessionSpec(served=True), 1, "OpenAI-compatible server"),
    (CPU, SessionSpec(), 2, "2 ranks"),
    (CPU, SessionSpec(in_process=False), 1, "--distributed-executor-backend mp"),
    (GPU, SessionSpec(), 1, "on a GPU"),
])
def test_the_engine_core_stays_apart_where_one_process_cannot_run_it(host_tree, device, session, ranks, why):
    layout = VLLM_RULES.engine_processes(device, session, ranks, read_host(host_tree()))
    assert not layout.in_process and why in layout.reason
    assert dict(layout.env) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def test_the_plan_states_its_process_layout_and_runs_what_it_states(monkeypatch, host_tree):
    from test_plan import plan_with_cpu

    host = read_host(host_tree(cores=2))
    one = plan_with_cpu(monkeypatch, DEMO_MODEL, host, max_model_len=512)
    assert one.admitted and one.execution is not None and one.execution.in_process and one.session.in_process
    assert one.engine_kwargs["distributed_executor_backend"] == vllm_launch.EXECUTOR_UNI
    doc = one.to_dict()["execution"]
    assert (doc["processes"], doc["in_process"], doc["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"]) == ("one", True, "0")
    served = plan_with_cpu(monkeypatch, DEMO_MODEL, host, max_model_len=512, served=True)
    assert not served.execution.in_process and "distributed_executor_backend" not in served.engine_kwargs
    baseline = {p: next(t.bytes for t in plan.reservations if t.purpose == "runtime_baseline")
                for p, plan in (("one", one), ("served", served))}
    edge_cpu_memory = pytest.importorskip("edge_cpu._memory")
    assert baseline == {"one": edge_cpu_memory.RUNTIME_BASELINE_ONE_PROCESS_BYTES,
                        "served": edge_cpu_memory.RUNTIME_BASELINE_BYTES}
    # The one process's libraries' file pages: in the peak the tree PSS is checked against, not in admission.
    pages = {p: [t for t in plan.reservations if t.purpose == "runtime_file_pages"]
             for p, plan in (("one", one), ("served", served))}
    assert pages["served"] == [] and [t.bytes for t in pages["one"]] == [
        edge_cpu_memory.RUNTIME_FILE_PAGES_ONE_PROCESS_BYTES]
    assert pages["one"][0].reclaimable
    assert one.peak.predicted_bytes - one.peak.held_bytes >= edge_cpu_memory.RUNTIME_FILE_PAGES_ONE_PROCESS_BYTES
    without = [t for t in one.reservations if t.purpose != "runtime_file_pages"]
    assert one.peak.admission_bytes == combine(without, "host_ram").admission_bytes


def test_a_parallel_layout_keeps_vllms_executor_and_says_why(monkeypatch, host_tree):
    from test_plan import plan_with_cpu

    from edge_core.plan.parallel import ParallelRequest

    plan = plan_with_cpu(monkeypatch, DEMO_MODEL, read_host(host_tree(cores=2)), parallel=ParallelRequest(tp=2),
                         max_model_len=512)
    assert plan.admitted and plan.execution is not None and not plan.execution.in_process
    assert "2 ranks" in plan.execution.processes_reason and plan.engine_kwargs["distributed_executor_backend"] == "mp"


@pytest.mark.parametrize("argv,served,in_process", [
    (["run"], False, None), (["serve"], True, None), (["plan"], False, None),
    (["run", "--distributed-executor-backend", "mp"], False, False),
])
def test_the_command_line_says_what_the_layout_depends_on(argv, served, in_process):
    from edge_core.cli.plan import session_from

    session = session_from(build_parser().parse_args(argv))
    assert (session.served, session.in_process) == (served, in_process)


def test_with_processes_copies_the_engines_answer():
    mode = ExecutionMode(enforce_eager=True, source="backend", reason="r")
    layout = vllm_launch.engine_processes(CPU, SessionSpec(served=True), 1, None)
    got = with_processes(mode, layout)
    assert (got.in_process, got.processes_reason, dict(got.env), got.reason) == \
        (False, vllm_launch.SERVED_REASON, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "r")
