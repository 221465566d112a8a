"""Export one stage of a Llama-family checkpoint to ONNX: fp32, fp16, and an A16W8 QDQ graph.

iGPUs and NPUs execute exported graphs, one stage at a time, never a whole
checkpoint (SPEC section 4). This script makes such a stage from the bundled
demo checkpoint (or any Llama-style safetensors checkpoint) so the whole graph
path — plan, start, measured placement, numeric gate — runs on ONNX Runtime's
CPU provider on any machine:

* ``mlp``     layer N's post-attention RMSNorm, SwiGLU MLP and residual add:
              ``hidden_states [batch, sequence, hidden] -> mlp_out`` (default);
* ``lm_head`` the final RMSNorm and the LM head: ``hidden_states -> logits``.

Each stage is written three ways: ``<stage>.fp32.onnx``, ``<stage>.fp16.onnx``
(weights and I/O in fp16) and ``<stage>.a16w8.onnx``, quantized from the fp32
graph by ONNX Runtime's ``quantize_static`` with 16-bit activations (QUInt16),
8-bit weights (QInt8) and QDQ format — the scheme the XDNA2 NPU executes. The
fp16 and A16W8 graphs name the fp32 graph as their numeric reference in their
metadata (``edge.reference_graph``); ``edge run --model`` checks them against it.

Why the graph is built with ``onnx.helper`` from the safetensors bytes instead
of ``torch.onnx.export``: the stage is a dozen operators whose meaning is fixed
by the Llama architecture, so building it directly needs neither torch nor
transformers (torch 2.13's default exporter also wants onnxscript), gives
stable node names and byte-identical output across runs, and keeps the script
runnable in any environment that has onnx and onnxruntime.

    python scripts/export_stage.py --out /tmp/edge-stage           # demo, layer 0 MLP
    python scripts/export_stage.py --model DIR --stage lm_head --out OUT
    edge plan --model /tmp/edge-stage/mlp0.a16w8.onnx
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "edge_core" / "demo" / "tiny-llama"

#: ONNX opset of the exported graphs: 21 is the first with 16-bit Q/DQ in the
#: default domain, which the A16W8 graph needs (quantize_static upgrades to it anyway).
OPSET = 21
FORMATS = ("fp32", "fp16", "a16w8")
#: Calibration batches and their shape (estimate: 16 x 16 tokens of N(0, 1)
#: hidden states pins the 16-bit activation ranges of a stage this small).
CALIBRATION_BATCHES = 16
CALIBRATION_SHAPE = (1, 16)
#: Symbolic dimension sizes edge uses for sample inputs of the exported graph.
SAMPLE_DIMS = {"batch": 1, "sequence": 8}

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64}


# ------------------------------------------------------------------ weights

def _read_safetensors(path: Path, wanted: set[str]) -> dict[str, np.ndarray]:
    """The ``wanted`` tensors of one safetensors file as float32 arrays (bf16 widened exactly)."""
    out = {}
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        base = 8 + length
        for name in sorted(wanted & set(header)):
            entry = header[name]
            start, end = entry["data_offsets"]
            handle.seek(base + start)
            raw = handle.read(end - start)
            dtype = entry["dtype"]
            if dtype not in _SAFETENSORS_DTYPES:
                raise SystemExit(f"{path}: tensor {name} is {dtype}; export_stage reads F32, F16 and BF16 weights")
            if dtype == "BF16":  # bf16 is the top half of an fp32: widening is a shift, exact
                array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                array = np.frombuffer(raw, dtype=_SAFETENSORS_DTYPES[dtype]).astype(np.float32)
            out[name] = array.reshape(entry["shape"])
    return out


def read_weights(model_dir: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The named tensors of a checkpoint, single-file or sharded (``model.safetensors.index.json``)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {weight_map[n] for n in names if n in weight_map}
    else:
        files = {"model.safetensors"}
    found: dict[str, np.ndarray] = {}
    for name in sorted(files):
        found.update(_read_safetensors(model_dir / name, set(names)))
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{model_dir} has no tensor {', '.join(missing)}; is it a Llama-style checkpoint?")
    return found


# ------------------------------------------------------------------ graphs

def _rms_norm(helper: Any, x: str, weight: str, eps: str, prefix: str) -> tuple[list[Any], str]:
    """RMSNorm as primitive operators: x / sqrt(mean(x^2) + eps) * weight."""
    nodes = [
        helper.make_node("Mul", [x, x], [f"{prefix}_sq"], name=f"{prefix}_square"),
        helper.make_node("ReduceMean", [f"{prefix}_sq", "norm_axes"], [f"{prefix}_ms"], name=f"{prefix}_mean",
                         keepdims=1),
        helper.make_node("Add", [f"{prefix}_ms", eps], [f"{prefix}_var"], name=f"{prefix}_add_eps"),
        helper.make_node("Sqrt", [f"{prefix}_var"], [f"{prefix}_rms"], name=f"{prefix}_sqrt"),
        helper.make_node("Div", [x, f"{prefix}_rms"], [f"{prefix}_unit"], name=f"{prefix}_normalize"),
        helper.make_node("Mul", [f"{prefix}_unit", weight], [f"{prefix}_out"], name=f"{prefix}_scale"),
    ]
    return nodes, f"{prefix}_out"


def build_stage(config: dict[str, Any], weights: dict[str, np.ndarray], stage: str, layer: int,
                dtype: str) -> Any:
    """The stage's ONNX model with weights in ``dtype`` (``float32`` or ``float16``) and I/O to match."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    elem = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    hidden = int(config["hidden_size"])
    eps = float(config.get("rms_norm_eps", 1e-6))

    def init(name: str, array: np.ndarray) -> Any:
        return numpy_helper.from_array(np.ascontiguousarray(array.astype(dtype)), name)

    inits = [numpy_helper.from_array(np.array([-1], dtype=np.int64), "norm_axes"),
             init("rms_eps", np.array(eps, dtype=np.float32))]
    x = "hidden_states"
    if stage == "mlp":
        p = f"model.layers.{layer}"
        nodes, normed = _rms_norm(helper, x, "post_attention_layernorm.weight", "rms_eps", "norm")
        inits += [
            init("post_attention_layernorm.weight", weights[f"{p}.post_attention_layernorm.weight"]),
            # torch Linear stores [out, in]; MatMul wants [in, out].
            init("gate_proj.weight_t", weights[f"{p}.mlp.gate_proj.weight"].T),
            init("up_proj.weight_t", weights[f"{p}.mlp.up_proj.weight"].T),
            init("down_proj.weight_t", weights[f"{p}.mlp.down_proj.weight"].T),
        ]
        nodes += [
            helper.make_node("MatMul", [normed, "gate_proj.weight_t"], ["gate"], name="gate_proj"),
            helper.make_node("MatMul", [normed, "up_proj.weight_t"], ["up"], name="up_proj"),
            helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"], name="act_sigmoid"),
            helper.make_node("Mul", ["gate", "gate_sigmoid"], ["gate_silu"], name="act_silu"),
            helper.make_node("Mul", ["gate_silu", "up"], ["gated"], name="gate_times_up"),
            helper.make_node("MatMul", ["gated", "down_proj.weight_t"], ["mlp"], name="down_proj"),
            helper.make_node("Add", [x, "mlp"], ["mlp_out"], name="residual_add"),
        ]
        output, out_dim = "mlp_out", hidden
    elif stage == "lm_head":
        head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
        nodes, normed = _rms_norm(helper, x, "norm.weight", "rms_eps", "final_norm")
        inits += [init("norm.weight", weights["model.norm.weight"]), init("lm_head.weight_t", weights[head].T)]
        nodes.append(helper.make_node("MatMul", [normed, "lm_head.weight_t"], ["logits"], name="lm_head"))
        output, out_dim = "logits", int(config["vocab_size"])
    else:
        raise SystemExit(f"unknown stage {stage!r}: choose mlp or lm_head")
    graph = helper.make_graph(
        nodes, f"{stage}{layer if stage == 'mlp' else ''}", [
            helper.make_tensor_value_info(x, elem, ["batch", "sequence", hidden])],
        [helper.make_tensor_value_info(output, elem, ["batch", "sequence", out_dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="edge export_stage", producer_version="1")
    model.ir_version = 10  # readable by every ONNX Runtime that runs opset 21
    onnx.checker.check_model(model)
    return model


def _weights_for(config: dict[str, Any], stage: str, layer: int) -> list[str]:
    if stage == "mlp":
        p = f"model.layers.{layer}"
        return [f"{p}.post_attention_layernorm.weight", f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight",
                f"{p}.mlp.down_proj.weight"]
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    return ["model.norm.weight", head]


def _calibration(hidden: int, seed: int, scale: float) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for _ in range(CALIBRATION_BATCHES):
        yield {"hidden_states": (scale * rng.standard_normal((*CALIBRATION_SHAPE, hidden))).astype(np.float32)}


def quantize_a16w8(fp32_path: Path, out_path: Path, hidden: int, seed: int, calibration_scale: float = 1.0) -> None:
    """A16W8 QDQ: 16-bit activations (QUInt16), 8-bit symmetric weights (QInt8), MinMax calibration.

    quantize_static gives the constant operand of an elementwise op (the RMSNorm
    weight, epsilon) the *activation* type, which would leave 16-bit constants
    in an A16W8 graph; every initializer is overridden to QInt8 so that every
    constant is 8-bit and every activation 16-bit.
    """
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    constants = sorted(t.name for t in onnx.load(str(fp32_path)).graph.initializer
                       if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))
    overrides = {name: [{"quant_type": QuantType.QInt8, "symmetric": True}] for name in constants}

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = _calibration(hidden, seed, calibration_scale)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_static logs advice about pre-processing on every call
    try:
        quantize_static(str(fp32_path), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt16, weight_type=QuantType.QInt8, per_channel=False,
                        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False,
                                       "TensorQuantOverrides": overrides})
    finally:
        root.setLevel(level)


def _stamp(path: Path, props: dict[str, str]) -> None:
    import onnx

    model = onnx.load(str(path))
    existing = {p.key: p for p in model.metadata_props}
    for key, value in props.items():
        if key in existing:
            existing[key].value = value
        else:
            model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def export_stage(model_dir: str | os.PathLike[str] = DEMO, out_dir: str | os.PathLike[str] | None = None, *,
                 stage: str = "mlp", layer: int = 0, formats: tuple[str, ...] = FORMATS,
                 seed: int = 1234, calibration_scale: float = 1.0) -> dict[str, Path]:
    """Write the stage's graphs into ``out_dir`` (a new temp dir if None); return format -> path.

    The fp32 graph is always written: it is the others' numeric reference and
    the A16W8 graph's quantization source. ``config.json`` is copied beside the
    graphs so their manifests name the architecture. ``calibration_scale`` is
    the standard deviation of the calibration hidden states (1.0: the sample
    inputs edge runs with); calibrating on a narrower range than the stage
    sees clips its activations, which the numeric gate is there to catch.
    """
    import onnx

    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="edge-stage-"))
    out.mkdir(parents=True, exist_ok=True)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    weights = read_weights(model_dir, _weights_for(config, stage, layer))
    name = f"{stage}{layer}" if stage == "mlp" else stage
    paths = {"fp32": out / f"{name}.fp32.onnx"}
    common = {"edge.stage": f"model.layers.{layer}.mlp" if stage == "mlp" else "lm_head",
              "edge.source_model": model_dir.name, "edge.sample_dims": json.dumps(SAMPLE_DIMS, sort_keys=True)}
    onnx.save(build_stage(config, weights, stage, layer, "float32"), str(paths["fp32"]))
    _stamp(paths["fp32"], {**common, "edge.format": "onnx:fp32"})
    reference = {"edge.reference_graph": paths["fp32"].name}
    if "fp16" in formats:
        paths["fp16"] = out / f"{name}.fp16.onnx"
        onnx.save(build_stage(config, weights, stage, layer, "float16"), str(paths["fp16"]))
        _stamp(paths["fp16"], {**common, **reference, "edge.format": "onnx:fp16"})
    if "a16w8" in formats:
        paths["a16w8"] = out / f"{name}.a16w8.onnx"
        quantize_a16w8(paths["fp32"], paths["a16w8"], int(config["hidden_size"]), seed, calibration_scale)
        _stamp(paths["a16w8"], {**common, **reference, "edge.format": "onnx:a16w8"})
    if (model_dir / "config.json").exists():
        shutil.copyfile(model_dir / "config.json", out / "config.json")
    return {f: paths[f] for f in ("fp32", *formats) if f in paths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO), help=f"Llama-style checkpoint directory (default {DEMO})")
    parser.add_argument("--out", help="output directory (default: a new temporary directory)")
    parser.add_argument("--stage", default="mlp", choices=("mlp", "lm_head"))
    parser.add_argument("--layer", type=int, default=0, help="decoder layer of the mlp stage (default 0)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of fp32,fp16,a16w8")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from edge_core.artifact import read_manifest

    paths = export_stage(args.model, args.out, stage=args.stage, layer=args.layer,
                         formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()))
    for fmt, path in paths.items():
        manifest = read_manifest(str(path))
        print(f"{fmt:<6} {path}  ({manifest.weight_format}, {manifest.weight_bytes:,} weight bytes, "
              f"{manifest.onnx['node_count']} nodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
