"""Which DirectML route drives an integrated GPU here, and so which exported formats it takes.

DirectML is reached two ways (SPEC section 4): ONNX Runtime's DirectML build on
Windows, which executes ONNX graphs, and torch-directml under WSL, which
executes a torch export. The route that resolves decides the format set; a
route resolves only when its runtime distribution is installed in this
interpreter, read from metadata, never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from edge_core import runtimes

#: fp32 throughput measured on a Ryzen AI laptop (SPEC section 4), TFLOP/s:
#: DirectML under WSL against the CPU it shares memory with. The DirectML route
#: was *slower*, so routes are ranked and the WSL route carries that finding
#: instead of being assumed faster than the CPU. Evidence B there, E elsewhere.
WSL_DML_FP32_TFLOPS = 1.23
SAME_HOST_CPU_FP32_TFLOPS = 1.54


@dataclass(frozen=True)
class Route:
    """One way to reach DirectML: where it applies, what provides it, what it executes."""

    backend: str
    #: ``windows`` (native Windows Python) or ``wsl`` (Linux under WSL 2, via /dev/dxg).
    platform: str
    distribution: str
    formats: tuple[str, ...]
    install: str
    #: Distributions that install the same import package and overwrite it.
    conflicts: tuple[str, ...] = ()
    note: str | None = None


#: Routes in preference order. ONNX Runtime's DirectML EP is the maintained
#: path; torch-directml under WSL ranks last because it measured slower than the CPU.
ROUTES: tuple[Route, ...] = (
    Route(
        backend="ort:dml",
        platform="windows",
        distribution="onnxruntime-directml",
        formats=("onnx:fp16", "onnx:fp32"),
        install="pip install edge-dml (pulls onnxruntime-directml)",
        # All three ship the `onnxruntime` package; whichever was installed last wins.
        conflicts=("onnxruntime", "onnxruntime-gpu"),
    ),
    Route(
        backend="torch:dml",
        platform="wsl",
        distribution="torch-directml",
        formats=("pt:fp16", "pt:fp32"),
        install='pip install "edge-dml[wsl]" (torch-directml)',
        note=(
            f"DirectML under WSL measured slower than the CPU it shares memory with "
            f"({WSL_DML_FP32_TFLOPS} vs {SAME_HOST_CPU_FP32_TFLOPS} TFLOP/s fp32, Ryzen AI "
            f"laptop); prefer the CPU backend for throughput"
        ),
    ),
)
ROUTES_BY_BACKEND = {route.backend: route for route in ROUTES}


def resolve(
    platform: str, version_of: Callable[[str], str | None] | None = None
) -> tuple[Route | None, Route | None, str | None]:
    """Return (resolved route, best candidate route, reason none resolved).

    ``platform`` is ``windows``, ``wsl`` or anything else (no route applies).
    ``version_of`` looks up an installed distribution's version; it defaults to
    :func:`edge_core.runtimes.installed_version`, looked up at call time.
    """
    version_of = version_of or (lambda name: runtimes.installed_version(name))
    candidates = [route for route in ROUTES if route.platform == platform]
    if not candidates:
        return None, None, "DirectML needs Windows or WSL"
    reasons = []
    for route in candidates:
        version = version_of(route.distribution)
        clashing = [name for name in route.conflicts if version_of(name) is not None]
        if version is not None and not clashing:
            return route, route, None
        if version is None:
            reasons.append(f"{route.distribution} is not installed in this interpreter: {route.install}")
        else:
            reasons.append(
                f"{route.distribution} {version} is installed beside {', '.join(clashing)}; they "
                f"overwrite the same package: pip uninstall {' '.join(clashing)}, then reinstall "
                f"{route.distribution}"
            )
    return None, candidates[0], "; ".join(reasons)
