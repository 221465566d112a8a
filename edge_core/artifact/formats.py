"""Which weight format a checkpoint is in, and its scheme, read from its ``quantization_config``.

The *format* is a name as the checkpoint's ``quantization_config`` says it
(``dense`` for none; ``compressed-tensors:int8`` (W8A8), ``gptq``, ``awq``,
``fp8``, ``mxfp4``, ``modelopt_fp4``, ``bitsandbytes``, ...). One name can hide
several schemes that a runtime treats differently — vLLM CPU runs 4-bit
symmetric GPTQ but not 8-bit, block-scaled fp8 but not per-tensor fp8 — so the
*scheme* (:func:`quantization_scheme_for`: bits, group size, symmetry,
``desc_act``, scale granularity, static or dynamic activations) travels beside
the name for the gates to judge.

A valid checkpoint whose ``quant_method`` edge has no name for is still a
named format, ``unknown:<method>``, which every device refuses as
``weight_format_unsupported``; only a config that is malformed is
``artifact_invalid``.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ArtifactError
from ._files import is_int

#: quant_method values edge names a format for (docs/writing-a-backend.md, ``weight_formats``; mxfp4: gpt-oss).
KNOWN_QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "modelopt", "bitsandbytes", "mxfp4")

#: Prefix of the format of a valid checkpoint whose quant_method (or ModelOpt quant_algo) edge does not know.
UNKNOWN_FORMAT_PREFIX = "unknown:"

#: What a quant_method looks like (``hqq``, ``torchao``, ``quark``, ``gpt_oss_mxfp4``): anything else
#: in that field is a broken config, not a method edge merely does not know.
_METHOD_NAME = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,63}")

#: ModelOpt quant_algo -> format; NVFP4 weights with fp8 block scales are ``modelopt_fp4``.
_MODELOPT_ALGOS = {
    "NVFP4": "modelopt_fp4", "W4A16_NVFP4": "modelopt_fp4",
    "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "FP8_PB_WO": "fp8",
}


def _method_of(quantization: dict[str, Any]) -> str | None:
    method = quantization.get("quant_method")
    if not isinstance(method, str) or not method:
        return None
    method = method.lower()
    return "compressed-tensors" if method == "compressed_tensors" else method


def weight_format_for(quantization: dict[str, Any] | None, where: str = "config.json") -> str:
    """The format name backends gate on for a ``quantization_config`` (``dense`` for None)."""
    if quantization is None:
        return "dense"
    if not isinstance(quantization, dict):
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} is not a JSON object",
                            "fix or re-download the checkpoint's config", where)
    method = _method_of(quantization)
    if method is None:
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} names no quant_method",
                            f"fix the checkpoint's config; edge knows {', '.join(KNOWN_QUANT_METHODS)}", where)
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization, where)
    if method in ("gptq", "awq", "fp8", "bitsandbytes", "mxfp4"):
        return method
    if method.startswith("modelopt"):
        return _modelopt_format(quantization, where)
    if not _METHOD_NAME.fullmatch(method):
        raise ArtifactError("artifact_invalid",
                            f"quant_method {method[:80]!r} in {where} is not a quantization method name",
                            "fix or re-download the checkpoint's config", where)
    # A real method edge has no rule for (hqq, torchao, quark, ...): named, so that
    # every device refuses it as a format it does not execute, never as a broken file.
    return UNKNOWN_FORMAT_PREFIX + method


def _modelopt_algo(q: dict[str, Any]) -> Any:
    # ModelOpt writes either {"quantization": {"quant_algo": ...}} or a flat quant_algo.
    nested = q.get("quantization")
    return (nested if isinstance(nested, dict) else q).get("quant_algo")


def _modelopt_format(q: dict[str, Any], where: str) -> str:
    algo = _modelopt_algo(q)
    if not isinstance(algo, str) or not _METHOD_NAME.fullmatch(algo.lower()):
        raise ArtifactError("artifact_invalid", f"ModelOpt quant_algo {algo!r} in {where} is not an algorithm name "
                            f"(edge knows {', '.join(_MODELOPT_ALGOS)})",
                            "re-export the checkpoint with NVIDIA ModelOpt", where)
    return _MODELOPT_ALGOS.get(algo.upper(), f"{UNKNOWN_FORMAT_PREFIX}modelopt:{algo.lower()}")


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
    # A scheme with no common name still gets a precise one, so a refusal can say what it is.
    suffix = "" if wtype == "int" else f"-{wtype}"
    return f"compressed-tensors:w{wbits}a{abits if is_int(abits) else 16}{suffix}"


# ---------------------------------------------------------------- schemes

#: Keys of every scheme dict, in this order; None where the checkpoint does not say or it does not apply.
SCHEME_KEYS = (
    "method",             # quant_method as vLLM looks it up (lower case; "modelopt" for ModelOpt exports)
    "weight_type",        # "int" or "float"
    "weight_bits",        # bits per stored weight value
    "group_size",         # values per scale along the input dim; -1 = one group per output channel
    "symmetric",          # no zero point
    "desc_act",           # GPTQ activation-order (act-order) groups
    "weight_scale",       # scale granularity: "tensor", "channel", "group" or "block"
    "weight_block_size",  # [rows, cols] of a block scale
    "activation_type",    # None: weight-only (activations stay 16-bit)
    "activation_bits",
    "activation_dynamic",  # True: scales computed per forward pass; False: static scales in the checkpoint
    "activation_scale",   # "tensor", "token" or "group"; None when the runtime picks
)


def _int_or_none(value: Any) -> int | None:
    return value if is_int(value) else None


def _bool_or_none(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _scheme(method: str, **values: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(SCHEME_KEYS)
    out["method"] = method
    out.update(values)
    return out


def quantization_scheme_for(quantization: Any) -> dict[str, Any] | None:
    """The scheme behind a ``quantization_config``: what a gate needs beyond the format name.

    Never raises: a field the checkpoint leaves out, or writes in a shape this
    reader does not know, is None (the format name has already judged whether
    the config is valid). Every dict has :data:`SCHEME_KEYS`, plus a few
    method-specific ones (``zero_point`` for AWQ, ``algo`` for ModelOpt,
    ``mixed`` for compressed-tensors groups that disagree). None for a dense
    checkpoint.
    """
    if not isinstance(quantization, dict):
        return None
    method = _method_of(quantization)
    if method is None:
        return None
    q = quantization
    if method == "gptq":
        group = _int_or_none(q.get("group_size"))
        return _scheme(method, weight_type="int", weight_bits=_int_or_none(q.get("bits")), group_size=group,
                       symmetric=_bool_or_none(q.get("sym")), desc_act=_bool_or_none(q.get("desc_act")),
                       weight_scale=None if group is None else ("channel" if group == -1 else "group"),
                       dynamic_overrides=bool(q.get("dynamic")))
    if method == "awq":
        group = _int_or_none(q.get("q_group_size", q.get("group_size")))
        zero_point = _bool_or_none(q.get("zero_point"))
        return _scheme(method, weight_type="int", weight_bits=_int_or_none(q.get("w_bit", q.get("bits"))),
                       group_size=group, symmetric=None if zero_point is None else not zero_point,
                       weight_scale=None if group is None else ("channel" if group == -1 else "group"),
                       zero_point=zero_point)
    if method == "fp8":
        return _fp8_scheme(q)
    if method == "mxfp4":
        # OCP MX: e2m1 values with one e8m0 scale per 32; vLLM runs the experts W4A16 (CPUExpertsMxfp4).
        return _scheme(method, weight_type="float", weight_bits=4, group_size=32, symmetric=True,
                       weight_scale="group")
    if method == "bitsandbytes":
        four = q.get("load_in_4bit") is True
        eight = q.get("load_in_8bit") is True
        quant_type = q.get("bnb_4bit_quant_type") if four else None
        return _scheme(method, weight_type="float" if four else ("int" if eight else None),
                       weight_bits=4 if four else (8 if eight else None),
                       bnb_quant_type=quant_type if isinstance(quant_type, str) else None)
    if method.startswith("modelopt"):
        return _modelopt_scheme(q)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q)
    return _scheme(method)


def _fp8_scheme(q: dict[str, Any]) -> dict[str, Any]:
    block = q.get("weight_block_size")
    block = list(block) if isinstance(block, list) and len(block) == 2 and all(is_int(b) for b in block) else None
    activation = q.get("activation_scheme")
    dynamic = None if not isinstance(activation, str) else activation.lower() != "static"
    # vLLM's Fp8LinearMethod (fp8.py): block weights quantize activations per token group of
    # block[1] columns; static per-tensor activations read one scale; dynamic ones are the kernel's choice.
    scale = "group" if block is not None else ("tensor" if dynamic is False else None)
    return _scheme("fp8", weight_type="float", weight_bits=8, symmetric=True,
                   weight_scale="block" if block is not None else "tensor", weight_block_size=block,
                   activation_type="float", activation_bits=8, activation_dynamic=dynamic, activation_scale=scale)


def _modelopt_scheme(q: dict[str, Any]) -> dict[str, Any]:
    algo = _modelopt_algo(q)
    algo = algo.upper() if isinstance(algo, str) else None
    if algo == "FP8":
        return _scheme("modelopt", algo=algo, weight_type="float", weight_bits=8, symmetric=True,
                       weight_scale="tensor", activation_type="float", activation_bits=8,
                       activation_dynamic=False, activation_scale="tensor")
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return _scheme("modelopt", algo=algo, weight_type="float", weight_bits=8, symmetric=True,
                       weight_scale="channel", activation_type="float", activation_bits=8,
                       activation_dynamic=True, activation_scale="token")
    if algo == "FP8_PB_WO":
        return _scheme("modelopt", algo=algo, weight_type="float", weight_bits=8, symmetric=True,
                       weight_scale="block")
    if algo in ("NVFP4", "W4A16_NVFP4"):
        nested = q.get("quantization")
        group = _int_or_none((nested if isinstance(nested, dict) else q).get("group_size"))
        acts = algo == "NVFP4"
        return _scheme("modelopt", algo=algo, weight_type="float", weight_bits=4, group_size=group,
                       symmetric=True, weight_scale="group", activation_type="float" if acts else None,
                       activation_bits=4 if acts else None, activation_dynamic=True if acts else None,
                       activation_scale="group" if acts else None)
    return _scheme("modelopt", algo=algo)


#: compressed-tensors ``strategy`` -> the scale granularity of :data:`SCHEME_KEYS`.
_CT_STRATEGIES = {"tensor": "tensor", "channel": "channel", "group": "group", "block": "block",
                  "tensor_group": "group", "token": "token", "attn_head": "channel"}


def _ct_group_scheme(weights: dict[str, Any], acts: Any) -> dict[str, Any]:
    strategy = weights.get("strategy")
    block = weights.get("block_structure")
    block = list(block) if isinstance(block, list) and len(block) == 2 and all(is_int(b) for b in block) else None
    wtype = weights.get("type", "int")
    values: dict[str, Any] = {
        "weight_type": wtype if wtype in ("int", "float") else None,
        "weight_bits": _int_or_none(weights.get("num_bits")),
        "group_size": _int_or_none(weights.get("group_size")),
        "symmetric": _bool_or_none(weights.get("symmetric", True)),
        "weight_scale": _CT_STRATEGIES.get(strategy) if isinstance(strategy, str) else None,
        "weight_block_size": block,
        "actorder": weights.get("actorder") if isinstance(weights.get("actorder"), str) else None,
    }
    if isinstance(acts, dict):
        atype, astrategy = acts.get("type", "int"), acts.get("strategy")
        values.update(activation_type=atype if atype in ("int", "float") else None,
                      activation_bits=_int_or_none(acts.get("num_bits")),
                      activation_dynamic=_bool_or_none(acts.get("dynamic")),
                      activation_scale=_CT_STRATEGIES.get(astrategy) if isinstance(astrategy, str) else None)
    return values


def _compressed_tensors_scheme(q: dict[str, Any]) -> dict[str, Any]:
    groups = q.get("config_groups")
    found: list[dict[str, Any]] = []
    for group in (groups.values() if isinstance(groups, dict) else ()):
        if isinstance(group, dict) and isinstance(group.get("weights"), dict):
            scheme = _ct_group_scheme(group["weights"], group.get("input_activations"))
            if scheme not in found:
                found.append(scheme)
    fmt = q.get("format") if isinstance(q.get("format"), str) else None
    if len(found) == 1:
        return _scheme("compressed-tensors", storage_format=fmt, mixed=False, **found[0])
    return _scheme("compressed-tensors", storage_format=fmt, mixed=len(found) > 1)
