"""Which DirectML route drives an integrated GPU here, and so which exported formats it takes.

DirectML is reached two ways (docs/igpu-npu-facts.md): ONNX Runtime's DirectML build in
a native Windows Python, which executes ONNX graphs, and torch-directml in a
Linux Python under WSL, which executes a torch export. The route that resolves
decides the format set. Routes resolve through the core's shared mechanism
(:mod:`edge_core.routes`): from installed metadata, never by importing, and a
route that does not resolve says why — not installed, clashing, or living in
another interpreter (from WSL, the Windows Python holding onnxruntime-directml).
"""

from __future__ import annotations

from collections.abc import Callable

from edge_core.routes import Resolution, Route
from edge_core.routes import resolve as resolve_routes

#: fp32 TFLOP/s on a Ryzen AI laptop, DirectML under WSL against the CPU it shares memory with
#: (docs/igpu-npu-facts.md, 'Two routes to DirectML, ranked'): the WSL route was *slower*, so it
#: ranks last and carries the finding. Evidence B there, E elsewhere.
WSL_DML_FP32_TFLOPS = 1.23
SAME_HOST_CPU_FP32_TFLOPS = 1.54

#: ONNX Runtime's name for the DirectML execution provider.
DML_PROVIDER = "DmlExecutionProvider"

#: Routes in preference order. ONNX Runtime's DirectML EP is the maintained path;
#: torch-directml under WSL ranks last because it ran slower than the CPU.
ROUTES: tuple[Route, ...] = (
    Route(
        backend="ort:dml",
        interpreter="windows",
        distribution="onnxruntime-directml",
        formats=("onnx:fp16", "onnx:fp32"),
        install="pip install edge-dml (pulls onnxruntime-directml)",
        provider=DML_PROVIDER,
        # All three ship the `onnxruntime` package; whichever was installed last wins.
        conflicts=("onnxruntime", "onnxruntime-gpu"),
    ),
    Route(
        backend="torch:dml",
        interpreter="wsl",
        distribution="torch-directml",
        formats=("pt:fp16", "pt:fp32"),
        install='pip install "edge-dml[wsl]" (torch-directml)',
        preference_note=(
            f"DirectML under WSL measured slower than the CPU it shares memory with "
            f"({WSL_DML_FP32_TFLOPS} vs {SAME_HOST_CPU_FP32_TFLOPS} TFLOP/s fp32, Ryzen AI "
            f"laptop); prefer the CPU backend for throughput"
        ),
    ),
)
ROUTES_BY_BACKEND = {route.backend: route for route in ROUTES}


def resolve(platform: str, version_of: Callable[[str], str | None] | None = None) -> Resolution:
    """Every DirectML route's status from an interpreter of kind ``platform`` (``windows``, ``wsl``, ``linux``).

    ``version_of`` looks up an installed distribution's version; it defaults to
    :func:`edge_core.builds.installed_version`, looked up at call time.
    """
    return resolve_routes(ROUTES, platform, version_of=version_of)
