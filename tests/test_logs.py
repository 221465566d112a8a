"""Where an engine's output goes (edge_core/runtime/logs.py): an engine started in edge's own process writes to the log."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, threading
    from edge_core.runtime.logs import EngineLog

    log = EngineLog(sys.argv[1])
    inside, shown = threading.Event(), threading.Event()

    def engine():  # what the stage's loop thread does while vLLM starts in this process
        with log.capture_engine_start():
            os.write(2, b"native warning from init_cpu_memory_env\\n")
            os.write(1, b"native print on stdout\\n")
            print("the loader's progress bar", file=sys.stderr)
            inside.set()
            shown.wait(10)

    thread = threading.Thread(target=engine)
    thread.start()
    inside.wait(10)
    print("edge: starting vllm:cpu ... 3 s", file=sys.stderr, flush=True)  # the main thread's progress
    shown.set()
    thread.join()
    os.write(2, b"after the start\\n")
    print("tokens on stdout")
""")


def test_an_engine_started_in_this_process_writes_to_the_log_and_edges_progress_stays(tmp_path):
    log = tmp_path / "engine.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = log.read_text()
    assert "native warning from init_cpu_memory_env" in written and "native print on stdout" in written
    assert "the loader's progress bar" in written
    assert "edge: starting" not in written and "after the start" not in written
    assert done.stderr.splitlines() == ["edge: starting vllm:cpu ... 3 s", "after the start"]
    assert done.stdout == "tokens on stdout\n"


def test_without_a_log_file_nothing_is_redirected(tmp_path):
    script = SCRIPT.replace("EngineLog(sys.argv[1])", "EngineLog(None)")
    done = subprocess.run([sys.executable, "-c", script, "unused"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "native warning from init_cpu_memory_env" in done.stderr and "native print on stdout" in done.stdout
