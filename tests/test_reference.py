"""Plain vLLM for ``edge parity``, in an interpreter of its own (edge_core/runtime/reference.py).

The boundary is faked: a ``vllm`` package on the child's path with ``LLM`` and
``SamplingParams``, which records the environment it ran in, answers token
ids, and can fail or leave a process behind as a broken engine would.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from edge_core.errors import StageError
from edge_core.runtime.logs import EngineLog
from edge_core.runtime.reaper import MARKER
from edge_core.runtime.reference import run_plain

FAKE_VLLM = textwrap.dedent("""
    import json, os, subprocess, sys
    from types import SimpleNamespace

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LLM:
        def __init__(self, **kwargs):
            print("INFO plain vLLM starting", flush=True)
            if kwargs.get("fail"):
                raise RuntimeError("Unsupported CPU attention configuration: head_dim=16")
            if kwargs.get("leave_behind"):  # an engine process that outlives its caller
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            with open(kwargs["seen"], "w") as handle:
                json.dump({k: os.environ.get(k) for k in ("EDGE_ENGINE", "VLLM_ENABLE_V1_MULTIPROCESSING")}, handle)
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def generate(self, prompts, params, use_tqdm=False):
            n = params.kwargs["max_tokens"]
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[len(p)] * n)]) for p in prompts]
""")


@pytest.fixture
def environ(tmp_path):
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    env = {k: v for k, v in os.environ.items() if k != "EDGE_ENGINE"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), *sys.path])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the plan's layout, handed over as edge's stage has it
    env[MARKER] = uuid.uuid4().hex  # the reference run's session marker
    return env


def test_the_reference_runs_plain_vllm_in_a_child_and_answers_its_token_ids(tmp_path, environ):
    seen = tmp_path / "seen.json"
    log = EngineLog(str(tmp_path / "engine.log"))
    ids, info = run_plain({"model": "m", "seen": str(seen)}, ["ab", "abcd"], 3, environ, log)
    assert ids == [[2, 2, 2], [4, 4, 4]]
    assert json.loads(seen.read_text()) == {"EDGE_ENGINE": None, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert len(info["pids"]) == 1 and not psutil.pid_exists(info["pids"][0])  # the child, waited for
    assert info["leftover_pids"] == [] and info["engine_start_s"] >= 0
    assert "plain vLLM starting" in (tmp_path / "engine.log").read_text()  # its output went to the engine log


def test_a_process_the_reference_left_is_ended_before_it_returns(tmp_path, environ):
    started = time.monotonic()
    _, info = run_plain({"model": "m", "seen": str(tmp_path / "seen.json"), "leave_behind": True}, ["x"], 1,
                        environ, EngineLog(None))
    assert len(info["terminated_pids"]) == 1 and info["leftover_pids"] == []
    assert not psutil.pid_exists(info["terminated_pids"][0]) or \
        psutil.Process(info["terminated_pids"][0]).status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 60


def test_a_failed_reference_names_the_cause_from_its_log(tmp_path, environ):
    log = EngineLog(str(tmp_path / "engine.log"))
    with pytest.raises(StageError, match="exited with code 1.*head_dim=16"):
        run_plain({"model": "m", "fail": True}, ["x"], 1, environ, log)
