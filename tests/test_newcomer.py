"""What a new user sees in the first hour (issue 25): errors that name the real mistake, help that matches
behaviour, a clean end after every result.

Terminal output is read from the real command's stderr and stdout (``python -m edge_core``, which is the
``edge`` executable's :func:`~edge_core.cli.console_main`). The tests that start vLLM read the suite's one
``edge run`` on the demo (conftest's ``demo_run``); what a clean ``edge serve`` stop leaves (items 1, 7, 12) is
checked on the suite's shared server, in tests/test_serve.py's SIGTERM test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from fake_hub import SilentEndpoint

from edge_core.artifact import DEMO_MODEL
from edge_core.cli import main
from edge_core.errors import PluginError
from edge_core.services.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
HAS_CPU = importlib.util.find_spec("edge_cpu") is not None
needs_cpu = pytest.mark.skipif(not HAS_CPU, reason="needs edge-cpu (the plan of the demo on this CPU)")
ENGINE_NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
needs_engine = [
    pytest.mark.engine, pytest.mark.slow, pytest.mark.vllm,
    pytest.mark.skipif(bool(ENGINE_NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {ENGINE_NEEDS}"),
]
#: What nanobind prints at exit when its objects were never collected (issue 25, item 1).
LEAK_REPORT = re.compile(r"nanobind|leaked \d+ (instances|types|functions)")


def edge(*args: str, env: dict[str, str] | None = None, stdin: int | None = subprocess.DEVNULL,
         input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          env={**os.environ, "EDGE_PROBE_TIMEOUT_S": "5", **(env or {})}, timeout=timeout,
                          **({"input": input} if input is not None else {"stdin": stdin}))


def installed_plugins() -> list[str]:
    return [r.name for r in Registry(allow=None, block=()).load()]


# ---------------------------------------------------------------- 2: a device list without its host

def test_a_device_list_with_a_cpu_and_no_host_section_is_a_usage_error_naming_host(tmp_path):
    doc = json.loads((ROOT / "tests" / "data" / "devices-cpu-32g.json").read_text())
    doc.pop("host")
    listed = tmp_path / "no-host.json"
    listed.write_text(json.dumps(doc))
    proc = edge("plan", "--devices", str(listed))
    assert proc.returncode == 64, proc.stderr
    assert "'host' section" in proc.stderr and str(listed) in proc.stderr and "devices[0]" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_edge_debug_shows_the_traceback_of_a_plugins_failure(monkeypatch, capsys):
    # A plugin's exception reaches the CLI as a PluginError naming it; EDGE_DEBUG=1 adds its traceback.
    import edge_core.cli.plan as plan_command

    def failing_plan(args):
        try:
            {}["numa_nodes"]
        except KeyError as exc:
            raise PluginError("plugin 'cpu' failed in gate_plan for device 'cpu': KeyError: 'numa_nodes'") from exc

    monkeypatch.setattr(plan_command, "cmd_plan", failing_plan)
    monkeypatch.delenv("EDGE_DEBUG", raising=False)
    assert main(["plan"]) == 1
    quiet = capsys.readouterr().err
    assert "Traceback" not in quiet and "EDGE_DEBUG=1" in quiet
    monkeypatch.setenv("EDGE_DEBUG", "1")
    assert main(["plan"]) == 1
    loud = capsys.readouterr().err
    assert "Traceback (most recent call last)" in loud and "failing_plan" in loud
    assert loud.rstrip().splitlines()[-1].startswith("edge: plugin 'cpu' failed in gate_plan")


# ---------------------------------------------------------------- 3: a filter that removed every candidate

def test_an_allow_list_that_leaves_out_every_installed_backend_says_so():
    installed = installed_plugins()
    if not installed:
        pytest.skip("needs an installed backend to leave out")
    proc = edge("plan", "--plugins", "nonexistent")
    assert proc.returncode == 2, proc.stderr
    [refused] = [line for line in proc.stdout.splitlines() if "[no_runnable_device]" in line]
    assert all(repr(name) in refused for name in installed) and "--plugins" in refused
    assert "allow-list" in proc.stderr and "'nonexistent'" in proc.stderr  # the warning `edge plugins` gives
    remedy = proc.stdout.split("[no_runnable_device]", 1)[1]
    assert "drop --plugins" in remedy


# ---------------------------------------------------------------- 4: help that matches behaviour

def test_serve_help_gives_the_max_num_seqs_default_serve_uses():
    from edge_core.cli.serve import SERVE_MAX_NUM_SEQS

    serve = " ".join(edge("serve", "--help").stdout.split())
    plan = " ".join(edge("plan", "--help").stdout.split())
    assert f"--max-num-seqs N sequences decoded at once; the rest wait (default {SERVE_MAX_NUM_SEQS})" in serve
    assert "--max-num-seqs N sequences decoded at once; the rest wait (default 1)" in plan


# ---------------------------------------------------------------- 5: one prefix, the command's usage, --version

@pytest.mark.parametrize("args,first", [
    (["plan", "--bogus"], "edge plan: unrecognized arguments: --bogus"),
    (["plan", "--max-model-len", "x"], "edge plan: argument --max-model-len: expected a whole number, got 'x'"),
    (["run", "stray"], "edge run: unrecognized arguments: stray"),
    (["--bogus"], "edge: unrecognized arguments: --bogus"),
])
def test_a_usage_error_has_one_prefix_and_the_commands_own_usage(args, first):
    proc = edge(*args)
    assert proc.returncode == 64, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == first and "edge: edge" not in proc.stderr
    command = args[0] if not args[0].startswith("-") else None
    assert lines[1].startswith(f"usage: edge {command} " if command else "usage: edge ")


def test_version_prints_the_version_and_exits_0():
    from edge_core import __version__

    proc = edge("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"edge {__version__}"


# ---------------------------------------------------------------- 6: a total deadline per decision

@pytest.mark.slow
def test_a_silent_hub_is_refused_within_the_timeout_as_a_total(tmp_path, monkeypatch):
    # huggingface_hub retries a timed-out request, so a per-request bound took 13.5 s for a 10 s timeout.
    import huggingface_hub

    from edge_core.artifact.hub import resolve_model
    from edge_core.errors import ArtifactError

    _ = huggingface_hub.HfApi  # loaded first: the deadline is the Hub's, not a busy machine's imports

    timeout_s = 2.0
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("EDGE_HUB_TIMEOUT", str(timeout_s))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with SilentEndpoint() as silent:
        monkeypatch.setenv("HF_ENDPOINT", silent.endpoint)
        started = time.monotonic()
        with pytest.raises(ArtifactError) as refused:
            resolve_model("org/silent-model", revision="v1")
        took = time.monotonic() - started
        assert silent.connections >= 1
    assert refused.value.code == "hub_unreachable"
    assert f"within {timeout_s:g} s" in str(refused.value)
    assert took < timeout_s + 1, f"the decision took {took:.1f} s against EDGE_HUB_TIMEOUT={timeout_s:g}"
    assert "`hf download org/silent-model --revision v1`" in refused.value.remedy  # 12: the revision kept


# ---------------------------------------------------------------- 7: engine logs private to the user

def test_the_default_engine_log_is_private_to_the_user(tmp_path, monkeypatch):
    from edge_core.runtime.logs import EngineLog

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"edge-logs-{os.getuid()}"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)  # as an earlier version left it
    log = EngineLog.for_session(None, "serve")
    assert log.path is not None and Path(log.path).parent == shared
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600  # made before vLLM's handler opens it
    log.route_runtime_logging({})
    assert stat.S_IMODE(os.stat(log.path + ".logging.json").st_mode) == 0o600
    log.remove()
    assert list(shared.iterdir()) == []


@needs_cpu
def test_a_serve_refused_for_its_address_leaves_no_log(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        done = edge("serve", "--port", str(holder.getsockname()[1]), env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 64, done.stderr[-2000:]
    assert list((tmp_path / f"edge-logs-{os.getuid()}").iterdir()) == []


# ---------------------------------------------------------------- 8: a forced stop says what it killed

@needs_cpu
def test_a_forced_stop_of_the_server_names_what_it_killed(tmp_path):
    # The second signal's handler of the real server, over a real child standing in for an engine process.
    script = textwrap.dedent("""
        import socket, subprocess, sys
        from edge_core.cli import build_parser
        from edge_core.cli.plan import plan_from_args
        from edge_core.runtime.reaper import SessionReaper
        from edge_core.runtime.vllm_server import VllmServer
        from edge_core.server import ServerOptions

        plan, registry = plan_from_args(build_parser().parse_args(["plan"]))
        SessionReaper().__enter__()  # the session's: it outlives the forced stop, and says nothing after it
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(engine.pid, flush=True)
        options = ServerOptions(host="127.0.0.1", port=1, served_model_name="demo", sock=socket.socket())
        server = VllmServer(plan.selected_device, plan, options)
        server.stage_pids = (engine.pid,)
        server._stopping = True  # the first signal's drain is under way
        server._on_signal(2, None, None, None)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EDGE_ENGINE_LOG": str(tmp_path / "engine.log")})
    engine = int(proc.stdout.split()[0])
    assert proc.returncode == 130, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # read to the reaper's exit: it holds the stderr
    assert last.startswith("edge: forced stop (a second SIGINT): killed ") and f"{engine} (python" in last
    assert "with SIGKILL" in last and f"engine log kept: {tmp_path / 'engine.log'}" in last
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(engine) and \
            psutil.Process(engine).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE


# ---------------------------------------------------------------- 11: remedies that fit the input

@pytest.mark.parametrize("model,remedy", [
    ("/nonexistent/path", "for a model on the Hugging Face Hub pass its id"),
    ("missing.onnx", "scripts/export_stage.py"),
])
def test_a_missing_path_gets_a_remedy_for_what_it_names(model, remedy):
    proc = edge("plan", "--model", model)
    assert proc.returncode == 2, proc.stderr
    assert remedy in proc.stdout and "huggingface-cli" not in proc.stdout
    assert "does not exist" in proc.stdout


def test_a_mistyped_local_directory_that_looks_like_a_hub_id_says_what_is_there(tmp_path):
    (tmp_path / "mymodels" / "llama-3").mkdir(parents=True)
    with socket.socket() as closed:  # a port nothing listens on: the Hub is unreachable at once
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "EDGE_HUB_TIMEOUT": "30"}
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", "mymodels/llama"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**inherited, **env},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "[hub_unreachable]" in proc.stdout, proc.stdout
    assert "no local directory mymodels/llama either (mymodels/ holds llama-3)" in proc.stdout


def test_a_hub_shaped_path_with_nothing_of_it_here_says_both(tmp_path):
    """The Hub is unreachable and no folder of that name exists: the refusal says both, and where it looked."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "EDGE_HUB_TIMEOUT": "30"}
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", "mymodels/llama-typo"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**inherited, **env},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "[hub_unreachable]" in proc.stdout, proc.stdout
    assert f"no local directory mymodels/ either in {tmp_path}" in " ".join(proc.stdout.split()), proc.stdout


# ---------------------------------------------------------------- 12: the small things

@needs_cpu
def test_the_plan_table_keeps_its_columns_for_the_longest_purpose():
    proc = edge("plan")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("purpose"))
    table = lines[start:start + 1 + sum(1 for line in lines[start + 1:] if " MiB  host_ram " in line)]
    assert any("linear_repack_transient" in row for row in table), table
    bytes_end = table[0].index("bytes") + len("bytes")
    pool = table[0].index("pool")
    for row in table[1:]:
        assert row.index(" MiB") + len(" MiB") == bytes_end and row.index("host_ram") == pool, row


def test_a_refusals_budget_line_is_in_mib_as_explain_is(capsys, monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    listed = ROOT / "tests" / "data" / "devices-cpu-32g.json"
    assert main(["plan", "--model", str(DEMO_MODEL), "--devices", str(listed), "--max-model-len", "2048",
                 "--kv-cache-memory", "64GiB"]) == 2
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("  budget ")]
    assert "GiB" not in line and re.search(r"needs [\d,]+ MiB of [\d,]+ MiB", line), line


def test_the_evidence_marks_of_edge_devices_are_explained():
    proc = edge("devices")
    assert proc.returncode == 0, proc.stderr
    if "[" not in proc.stdout.split("Devices", 1)[-1]:
        pytest.skip("no device listed, so no marks to explain")
    assert "D read from the OS or an artifact, B the backend ran something here, E an estimate" in proc.stdout


def test_top_level_help_lists_exit_130():
    assert "130 interrupted" in " ".join(edge("--help").stdout.split())


def test_ps_names_the_interpreter_as_devices_does(tmp_path):
    # A session's record, written by a child edge process as `edge run` writes it, read by `edge ps --json`.
    env = {"EDGE_LEDGER_DIR": str(tmp_path / "ledger")}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from edge_core.services.host_ledger import admission
            with admission() as taken:
                taken.register(command="edge run", model="demo", artifact_id=None, device_ids=("cpu",),
                               reserved_bytes={"host_ram": 1}, predicted_peak_bytes=1, headroom_bytes=0)
            print("registered", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert holder.stdout.readline().strip() == "registered"
        sessions = json.loads(edge("ps", "--json", env=env).stdout)["sessions"]
        devices = json.loads(edge("devices", "--json").stdout)
    finally:
        holder.kill()
        holder.wait()
    assert [s["interpreter"] for s in sessions] == [devices["interpreter"]] == [sys.executable]


def test_an_empty_piped_prompt_is_a_usage_error_not_the_demo_prompt():
    proc = edge("run", "--plugins", "none-installed", input="")
    assert proc.returncode == 64, (proc.returncode, proc.stderr)
    assert "stdin is empty" in proc.stderr and "--prompt" in proc.stderr


def test_the_readme_stands_alone():
    readme = (ROOT / "README.md").read_text()
    assert "../shared" not in readme
    for target in re.findall(r"\]\(([^)#]+)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


# ---------------------------------------------------------------- 13: the demo's text on a terminal

def test_generated_text_reaches_the_terminal_without_control_characters():
    from edge_core.cli.run import UNPRINTABLE_MARK, is_demo, printable

    shown = printable("work\x1b[2Jhat\ufffd\x07uild\x9b a line\n\ttab")
    assert shown == f"work{UNPRINTABLE_MARK}[2Jhat{UNPRINTABLE_MARK}{UNPRINTABLE_MARK}uild{UNPRINTABLE_MARK} a line\n\ttab"
    assert is_demo(str(DEMO_MODEL)) and not is_demo(str(ROOT))


# ---------------------------------------------------------------- the suite's one real `edge run` (1, 7, 10, 13)

class TestRealRun:
    # One engine, read by test_run.py's budget-line test too: both on the xdist worker that starts it.
    pytestmark = [*needs_engine, pytest.mark.xdist_group("demo_run")]

    def test_nothing_follows_the_summary(self, demo_run):
        proc, _ = demo_run
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not LEAK_REPORT.search(proc.stderr), proc.stderr[-3000:]
        assert proc.stderr.rstrip().splitlines()[-1].startswith("edge: starting "), proc.stderr[-1000:]
        last = proc.stdout.rstrip().splitlines()[-1]
        assert "lower bound" in last, last  # the budget's closing note is the last line

    def test_a_request_cut_by_the_context_says_so(self, demo_run):
        proc, _ = demo_run
        assert "--max-tokens 500 does not fit the 128-token context" in proc.stderr
        [tokens] = [line for line in proc.stdout.splitlines() if line.startswith("tokens    ")]
        count = int(tokens.split()[1])
        assert count < 500 and "cut at the 128-token context" in tokens and "asked for 500" in tokens

    def test_the_demo_model_answers_in_printable_text(self, demo_run):
        proc, _ = demo_run
        assert "random weights" not in proc.stderr  # a real model: no apology for noise
        generated = proc.stdout.split("decided in", 1)[1].split("\ntokens    ", 1)[0]
        assert "Paris" in generated, generated
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]", generated)

    def test_a_clean_runs_log_is_gone_from_a_private_folder(self, demo_run):
        proc, tmp = demo_run
        folder = tmp / f"edge-logs-{os.getuid()}"
        assert f"engine log: {folder}/" in proc.stderr
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and list(folder.iterdir()) == []


