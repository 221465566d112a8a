"""What is in this exported ONNX graph — opset, initializer bytes, precision scheme — read without running it.

iGPUs and NPUs execute exported graphs, and which one they take depends on the
graph's numeric scheme: the XDNA2 NPU runs only QDQ graphs with 16-bit
activations and 8-bit weights (``onnx:a16w8``); fp32 and A8W8 graphs are not
rejected by the runtime, they silently stay on the CPU (docs/writing-a-backend.md,
``format_remedy``). So the scheme is read from the graph itself: the
zero-point types of its QuantizeLinear nodes and the types of the initializers
its DequantizeLinear nodes read. The graph is parsed with ``onnx`` (an optional extra, imported
here only) with external data left on disk; external data files are checked
for containment and size, never read, unless a content digest is asked for.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

from ..errors import ArtifactError
from ..manifest import ARTIFACT_ID_HEX_CHARS, Manifest
from ._files import canonical, check_contained, content_digest, listdir, open_regular, regular_file
from .config import CONFIG_NAME, identity, read_config_sized, resolve_text_config

#: protobuf cannot serialize a message past 2 GiB; a larger .onnx is not a graph.
MAX_GRAPH_FILE_BYTES = 2**31
#: ONNX TensorProto data type name -> bits per element (sub-byte types pack, padded to a byte).
ONNX_DTYPE_BITS = {
    "FLOAT": 32, "UINT8": 8, "INT8": 8, "UINT16": 16, "INT16": 16, "INT32": 32, "INT64": 64, "BOOL": 8,
    "FLOAT16": 16, "DOUBLE": 64, "UINT32": 32, "UINT64": 64, "COMPLEX64": 64, "COMPLEX128": 128,
    "BFLOAT16": 16, "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8,
    "UINT4": 4, "INT4": 4, "FLOAT4E2M1": 4, "FLOAT8E8M0": 8, "UINT2": 2, "INT2": 2,
}
_FLOAT_NAMES = {"FLOAT": ("onnx:fp32", "float32"), "FLOAT16": ("onnx:fp16", "float16"),
                "BFLOAT16": ("onnx:bf16", "bfloat16"), "DOUBLE": ("onnx:fp32", "float64")}
#: Operators of the QOperator style (integer kernels instead of Q/DQ pairs).
_QOPERATORS = {"QLinearMatMul", "QLinearConv", "MatMulInteger", "DynamicQuantizeLinear",
               "MatMulIntegerToFloat", "QAttention", "DynamicQuantizeMatMul"}


def read_graph_manifest(root: str, name: str, digest_weights: bool = False) -> Manifest:
    """Manifest of the graph ``root/name``; raises :class:`ArtifactError` for anything unreadable."""
    path = os.path.join(root, name)
    try:
        import onnx
    except ImportError:
        raise ArtifactError("artifact_invalid", f"reading the ONNX graph {path} needs the onnx package, "
                            "which is not installed in this interpreter",
                            "pip install 'edge-core[onnx]'", path) from None
    with open_regular(path, f"ONNX graph {name}", "artifact_invalid", root) as (f, size):
        if size > MAX_GRAPH_FILE_BYTES:
            raise ArtifactError("artifact_invalid", f"{path} is {size} bytes, past protobuf's 2 GiB limit",
                                "re-export with external data (onnx.save(..., save_as_external_data=True))", path)
        data = f.read()
    try:
        model = onnx.load(io.BytesIO(data), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own types; any of them means "not a graph"
        raise ArtifactError("artifact_invalid", f"{path} is not a valid ONNX model: {type(exc).__name__}: {exc}",
                            "re-export the graph (torch.onnx.export or optimum-cli export onnx)", path) from None
    if not model.HasField("graph") or not model.graph.node:
        raise ArtifactError("artifact_invalid", f"{path} parses as protobuf but holds no graph nodes",
                            "re-export the graph (torch.onnx.export or optimum-cli export onnx)", path)

    raw_config: dict[str, Any] = {}
    config_files: list[tuple[str, int]] = []
    if CONFIG_NAME in listdir(root):  # optimum exports keep the model's config beside the graph
        raw_config, config_size = read_config_sized(root)
        config_files = [(CONFIG_NAME, config_size)]
    tensors, nodes = _walk(model.graph)
    dtype_bytes: dict[str, int] = {}
    external: dict[str, int] = {}
    for _, tensor in tensors:
        dtype, nbytes = _tensor_bytes(onnx, tensor, root, path, external)
        dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + nbytes
    scheme = _scheme(onnx, tensors, nodes)
    floats = {n: b for n, b in dtype_bytes.items() if n in _FLOAT_NAMES}
    dominant = max(sorted(floats), key=floats.__getitem__) if floats else "FLOAT"
    weight_format = scheme["format"] or _FLOAT_NAMES[dominant][0]

    files = [(name, size), *config_files, *sorted(external.items())]
    ident = hashlib.sha256(b"edge-graph-v1\0")
    ident.update(canonical(raw_config))
    ident.update(hashlib.sha256(data).digest())
    for ext_name, ext_size in sorted(external.items()):
        ident.update(f"{ext_name}\0{ext_size}\0".encode("utf-8", "surrogatepass"))
    opsets = {imp.domain or "ai.onnx": int(imp.version) for imp in model.opset_import}
    config, text_key = resolve_text_config(raw_config)
    architecture, model_type = identity(raw_config)
    return Manifest(
        path=path,
        kind="onnx",
        weight_format=weight_format,
        weight_bytes=sum(dtype_bytes.values()),
        dtype=_FLOAT_NAMES[dominant][1] if floats else None,
        dtype_bytes=dict(sorted(dtype_bytes.items())),
        architecture=architecture,
        model_type=model_type,
        tensor_count=len(tensors),
        files=tuple(files),
        total_file_bytes=sum(s for _, s in files),
        config=config,
        quantization=None,
        artifact_id=ident.hexdigest()[:ARTIFACT_ID_HEX_CHARS],
        content_digest=content_digest(root, [name, *external]) if digest_weights else None,
        onnx={
            "opset": opsets.get("ai.onnx"),
            "opsets": dict(sorted(opsets.items())),
            "ir_version": int(model.ir_version),
            "producer": f"{model.producer_name} {model.producer_version}".strip(),
            "node_count": len(nodes),
            "qdq": scheme["qdq"],
            "activation_bits": scheme["activation_bits"],
            "weight_bits": scheme["weight_bits"],
            "external_data_files": sorted(external),
        },
        text_config_key=text_key,
    )


def _walk(graph: Any) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Every weight-carrying tensor as (the name nodes use, tensor), and every node, subgraphs included."""
    tensors: list[tuple[str, Any]] = []
    nodes: list[Any] = []
    stack = [graph]
    while stack:  # iterative: a hostile file can nest subgraphs deeper than the recursion limit
        g = stack.pop()
        tensors.extend((t.name, t) for t in g.initializer)
        for sparse in g.sparse_initializer:
            tensors.extend(((sparse.values.name, sparse.values), (sparse.indices.name, sparse.indices)))
        for node in g.node:
            nodes.append(node)
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)
                if node.op_type == "Constant" and attr.HasField("t") and node.output:
                    tensors.append((node.output[0], attr.t))  # nodes refer to a Constant by its output
    return tensors, nodes


def _dtype_name(onnx: Any, code: int) -> str:
    try:
        return str(onnx.TensorProto.DataType.Name(code))
    except ValueError:
        return f"UNKNOWN({code})"


def _tensor_bytes(onnx: Any, tensor: Any, root: str, path: str, external: dict[str, int]) -> tuple[str, int]:
    dtype = _dtype_name(onnx, tensor.data_type)
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} has negative dims {dims}",
                            "re-export the graph", path)
    if dtype == "STRING":
        return dtype, sum(len(s) for s in tensor.string_data)
    if dtype not in ONNX_DTYPE_BITS:
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} has data type {dtype}, "
                            "which edge cannot size", "re-export the graph with standard tensor types", path)
    count = 1
    for d in dims:
        count *= d
    nbytes = (count * ONNX_DTYPE_BITS[dtype] + 7) // 8
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        _check_external(tensor, nbytes, root, path, external)
    elif tensor.HasField("raw_data") and len(tensor.raw_data) != nbytes:
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} ({dtype}, dims {dims}) carries "
                            f"{len(tensor.raw_data)} bytes; its shape needs {nbytes}", "re-export the graph", path)
    return dtype, nbytes


def _check_external(tensor: Any, nbytes: int, root: str, path: str, external: dict[str, int]) -> None:
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    try:
        check_contained(root, location, source=os.path.basename(path))
        offset = int(entries.get("offset", "0"))
        length = int(entries["length"]) if "length" in entries else nbytes
    except ValueError:
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} has malformed external data "
                            f"entries {entries}", "re-export the graph", path) from None
    if length != nbytes or offset < 0:
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} claims {length} external bytes at "
                            f"offset {offset}; its shape needs {nbytes}", "re-export the graph", path)
    if location not in external:
        st = regular_file(os.path.join(root, location), f"external data {location}", "artifact_invalid", root)
        external[location] = st.st_size
    if offset + length > external[location]:
        raise ArtifactError("artifact_invalid", f"{path}: tensor {tensor.name!r} reads bytes [{offset}, "
                            f"{offset + length}) of {location}, which has {external[location]} (truncated?)",
                            "copy the complete external data file beside the graph", path)


#: Operators whose constant inputs are the weights a scheme's "W" width names.
_WEIGHT_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")


def _scheme(onnx: Any, tensors: list[tuple[str, Any]], nodes: list[Any]) -> dict[str, Any]:
    """The graph's quantization scheme: activation and weight bit widths from its Q/DQ nodes."""
    T = onnx.TensorProto
    weights = {name: t.data_type for name, t in tensors}
    # None marks a width edge cannot name (an unknown type code): it keeps the scheme from being named.
    act_bits: set[int | None] = set()
    weight_bits: set[int | None] = set()
    constant_bits: dict[str, int | None] = {}
    qdq = False
    other_quant = None
    for node in nodes:
        inputs = list(node.input)
        if node.op_type == "QuantizeLinear":
            qdq = True
            zp_type = weights.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
            if zp_type is None:  # opset 21 names the type as an attribute; the default is uint8
                zp_type = next((a.i for a in node.attribute if a.name == "output_dtype" and a.i), T.UINT8)
            bits = ONNX_DTYPE_BITS.get(_dtype_name(onnx, zp_type))
            # Quantizing an initializer is a weight path left unfolded, not an activation.
            (weight_bits if inputs and inputs[0] in weights else act_bits).add(bits)
        elif node.op_type == "DequantizeLinear":
            qdq = True
            source = weights.get(inputs[0]) if inputs else None
            # int32 initializers behind a DequantizeLinear are quantized biases, not weights.
            if source is not None and source != T.INT32:
                bits = ONNX_DTYPE_BITS.get(_dtype_name(onnx, source))
                if node.output:  # a damaged graph's node may name no output; nothing then reads it
                    constant_bits[node.output[0]] = bits
                weight_bits.add(bits)
        elif node.op_type == "MatMulNBits":
            other_quant = f"onnx:w{next((a.i for a in node.attribute if a.name == 'bits'), 4)}-matmulnbits"
        elif node.op_type in _QOPERATORS:
            other_quant = other_quant or "onnx:qoperator"
    # The scheme is what the matrix products read: ONNX Runtime's A16W8 quantizer
    # keeps a norm's scale or an epsilon at 16 bits, which is not the weight width.
    product_bits = {constant_bits[name] for node in nodes if node.op_type in _WEIGHT_OPS
                    for name in node.input if name in constant_bits}
    if product_bits:
        weight_bits = product_bits
    fmt = None
    if qdq:
        if len(act_bits) == 1 and len(weight_bits) == 1 and None not in act_bits | weight_bits:
            fmt = f"onnx:a{next(iter(act_bits))}w{next(iter(weight_bits))}"
        else:
            fmt = "onnx:qdq"  # mixed or partial widths: named so a refusal can say what the graph is
    elif other_quant:
        fmt = other_quant
    return {"format": fmt, "qdq": qdq, "activation_bits": sorted(b for b in act_bits if b),
            "weight_bits": sorted(b for b in weight_bits if b)}
