"""Which weight format a checkpoint is in, named as its ``quantization_config`` says (SPEC section 4).

``dense`` for none; ``compressed-tensors:int8`` (W8A8), ``gptq``, ``awq``,
``fp8``, ``modelopt_fp4``, ... otherwise. The name decides which devices can
*execute* the checkpoint, so an unknown scheme gets a precise name too.
"""

from __future__ import annotations

from typing import Any

from ..errors import ArtifactError
from ._files import is_int

#: quant_method values edge can name a format for (SPEC section 4).
KNOWN_QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "modelopt", "bitsandbytes")


def weight_format_for(quantization: dict[str, Any] | None, where: str = "config.json") -> str:
    """SPEC section 4's format name for a ``quantization_config`` (``dense`` for None)."""
    if quantization is None:
        return "dense"
    if not isinstance(quantization, dict):
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} is not a JSON object",
                            "fix or re-download the checkpoint's config", where)
    method = quantization.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} names no quant_method",
                            f"fix the checkpoint's config; edge knows {', '.join(KNOWN_QUANT_METHODS)}", where)
    method = method.lower()
    if method == "compressed_tensors":
        method = "compressed-tensors"
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization, where)
    if method in ("gptq", "awq", "fp8", "bitsandbytes"):
        return method
    if method.startswith("modelopt"):
        return _modelopt_format(quantization, where)
    raise ArtifactError("artifact_invalid",
                        f"quantization method {method!r} in {where} is not one edge knows "
                        f"(known: {', '.join(KNOWN_QUANT_METHODS)})",
                        "use a checkpoint in one of the known formats, or a dense (unquantized) checkpoint", where)


def _modelopt_format(q: dict[str, Any], where: str) -> str:
    # ModelOpt writes either {"quantization": {"quant_algo": ...}} or a flat quant_algo.
    nested = q.get("quantization")
    algo = (nested if isinstance(nested, dict) else q).get("quant_algo")
    algo = algo.upper() if isinstance(algo, str) else None
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return "modelopt_fp4"
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        return "fp8"
    raise ArtifactError("artifact_invalid", f"ModelOpt quant_algo {algo!r} in {where} is not one edge knows "
                        "(known: NVFP4, W4A16_NVFP4, FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO)",
                        "use an NVFP4 or FP8 ModelOpt export, or the dense checkpoint", where)


#: compressed-tensors storage formats that pin the scheme when config_groups is silent.
_CT_FORMAT_HINTS = {
    "int-quantized": "compressed-tensors:int8",
    "float-quantized": "compressed-tensors:fp8",
    "pack-quantized": "compressed-tensors:w4a16",
    "nvfp4-pack-quantized": "compressed-tensors:nvfp4",
    "mxfp4-pack-quantized": "compressed-tensors:mxfp4",
}


def _compressed_tensors_format(q: dict[str, Any], where: str) -> str:
    hint = q.get("format") if isinstance(q.get("format"), str) else None
    groups = q.get("config_groups")
    if groups is not None and not isinstance(groups, dict):
        raise ArtifactError("artifact_invalid", f"compressed-tensors config_groups in {where} is not an object",
                            "re-export the checkpoint with llm-compressor", where)
    schemes = set()
    for name, group in (groups or {}).items():
        if not isinstance(group, dict):
            raise ArtifactError("artifact_invalid", f"compressed-tensors group {name!r} in {where} is not an object",
                                "re-export the checkpoint with llm-compressor", where)
        weights = group.get("weights")
        if weights is None:
            continue  # activation- or KV-only group: the weights stay dense
        schemes.add(_ct_scheme(weights, group.get("input_activations"), hint, name, where))
    if len(schemes) == 1:
        return schemes.pop()
    if len(schemes) > 1:
        return "compressed-tensors:mixed"
    if hint in _CT_FORMAT_HINTS:
        return _CT_FORMAT_HINTS[hint]
    if hint in (None, "dense", "sparse-bitmask", "sparse-24-bitmask"):
        return "dense"  # sparsity-only or KV-only compression: weights are full precision
    raise ArtifactError("artifact_invalid", f"compressed-tensors format {hint!r} in {where} names no weight scheme "
                        "and config_groups is empty", "re-export the checkpoint with llm-compressor", where)


def _ct_scheme(weights: Any, acts: Any, hint: str | None, group: str, where: str) -> str:
    if not isinstance(weights, dict) or (acts is not None and not isinstance(acts, dict)):
        raise ArtifactError("artifact_invalid", f"compressed-tensors group {group!r} in {where} has malformed "
                            "weights/input_activations", "re-export the checkpoint with llm-compressor", where)
    wbits, wtype = weights.get("num_bits"), weights.get("type", "int")
    if not is_int(wbits):
        if hint in _CT_FORMAT_HINTS:
            return _CT_FORMAT_HINTS[hint]
        raise ArtifactError("artifact_invalid", f"compressed-tensors group {group!r} in {where} has no weight num_bits",
                            "re-export the checkpoint with llm-compressor", where)
    abits = acts.get("num_bits") if acts else None
    atype = acts.get("type", "int") if acts else None
    if wtype == "int" and wbits == 8 and atype == "int" and abits == 8:
        return "compressed-tensors:int8"
    if wtype == "float" and wbits == 8 and (acts is None or (atype == "float" and abits == 8)):
        return "compressed-tensors:fp8"
    if wtype == "int" and wbits == 4 and acts is None:
        return "compressed-tensors:w4a16"
    if wtype == "float" and wbits == 4 and hint in _CT_FORMAT_HINTS:
        return _CT_FORMAT_HINTS[hint]
    # A scheme SPEC does not name still gets a precise name, so a refusal can say what it is.
    suffix = "" if wtype == "int" else f"-{wtype}"
    return f"compressed-tensors:w{wbits}a{abits if is_int(abits) else 16}{suffix}"

