"""What a graph stage is beyond its manifest: the graph's inputs, outputs and edge metadata, and its reference.

The stage planner (:mod:`edge_core.plan.graph_stage`) sizes activations from
the graph's I/O and judges its numbers against a reference graph; both are
read here, by the caller that plans, so the planner itself reads no file.
``onnx`` is imported only to read them (external data left on disk).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import ArtifactError

if TYPE_CHECKING:
    from ..manifest import Manifest

#: Graph metadata written by scripts/export_stage.py.
META_REFERENCE = "edge.reference_graph"
META_SAMPLE_DIMS = "edge.sample_dims"
META_STAGE = "edge.stage"

#: Symbolic dimensions for sizing and sample inputs when the graph names none.
DEFAULT_SAMPLE_DIMS = {"batch": 1, "batch_size": 1, "sequence": 8, "sequence_length": 8, "seq": 8}
DEFAULT_SAMPLE_DIM = 8

#: Bytes per element of each ONNX ``TensorProto`` element type the I/O may carry (float32 where unknown).
ELEMENT_BYTES = {1: 4, 10: 2, 16: 2, 11: 8, 7: 8, 6: 4, 3: 1, 2: 1, 5: 2, 4: 2, 9: 1, 21: 1, 22: 1}


@dataclass(frozen=True)
class GraphFacts:
    """What planning reads from the graph beyond its manifest: I/O, edge metadata and the reference graph."""

    inputs: tuple[tuple[str, int, tuple[Any, ...]], ...]
    outputs: tuple[tuple[str, int, tuple[Any, ...]], ...]
    metadata: dict[str, str]
    #: The graph the numeric gate compares against on the CPU provider, why that one, and its file size.
    reference_path: str = ""
    reference_why: str = ""
    reference_bytes: int = 0

    def sample_dims(self) -> dict[str, int]:
        """Size of each symbolic dimension of the graph's I/O: the graph's own, then the defaults."""
        dims = dict(DEFAULT_SAMPLE_DIMS)
        try:
            given = json.loads(self.metadata.get(META_SAMPLE_DIMS) or "{}")
        except ValueError:
            given = {}
        if isinstance(given, dict):
            dims.update({str(k): int(v) for k, v in given.items() if isinstance(v, int) and v > 0})
        named = {str(d) for _, _, shape in self.inputs + self.outputs for d in shape if not isinstance(d, int)}
        return {name: dims.get(name, DEFAULT_SAMPLE_DIM) for name in sorted(named)}

    def io_bytes(self) -> int:
        dims = self.sample_dims()
        total = 0
        for _, elem, shape in self.inputs + self.outputs:
            count = 1
            for d in shape:
                count *= d if isinstance(d, int) and d > 0 else dims.get(str(d), DEFAULT_SAMPLE_DIM)
            total += count * ELEMENT_BYTES.get(elem, 4)
        return total


def read_graph_facts(manifest: Manifest) -> GraphFacts:
    """I/O specs, ``metadata_props`` and the reference graph of the graph ``manifest`` describes.

    :class:`~edge_core.errors.ArtifactError` (``artifact_invalid``) when the graph cannot be read.
    """
    try:
        facts = _read(manifest.path)
    except Exception as exc:  # noqa: BLE001 - graph.py parsed it already; anything here is a bad graph
        raise ArtifactError("artifact_invalid", f"{manifest.path}: cannot read the graph's inputs and metadata: "
                            f"{type(exc).__name__}: {exc}", "re-export the graph") from exc
    path, why = resolve_reference(manifest, facts)
    return replace(facts, reference_path=path, reference_why=why,
                   reference_bytes=os.path.getsize(path) if path != manifest.path else 0)


def _read(path: str) -> GraphFacts:
    import onnx
    model = onnx.load(path, load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}

    def specs(values: Iterable[Any]) -> tuple[tuple[str, int, tuple[Any, ...]], ...]:
        out = []
        for v in values:
            if v.name in initializers:  # old exporters list initializers as inputs
                continue
            tensor = v.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            out.append((v.name, int(tensor.elem_type), shape))
        return tuple(out)

    return GraphFacts(specs(model.graph.input), specs(model.graph.output),
                      {p.key: p.value for p in model.metadata_props})


def resolve_reference(manifest: Manifest, facts: GraphFacts) -> tuple[str, str]:
    """The graph the numeric gate compares against on the CPU provider, and why that one.

    The graph's own ``edge.reference_graph`` (a file beside it, e.g. the fp32
    export an A16W8 graph was quantized from) when it names one that exists in
    the same directory; otherwise the same graph.
    """
    name = facts.metadata.get(META_REFERENCE)
    root = os.path.dirname(manifest.path)
    if name and os.path.basename(name) == name and name.lower().endswith(".onnx"):
        candidate = os.path.join(root, name)
        if os.path.isfile(candidate) and os.path.realpath(candidate) != os.path.realpath(manifest.path):
            return candidate, f"{name}, named by the graph's {META_REFERENCE} metadata"
    if name:
        return manifest.path, f"the same graph ({META_REFERENCE}={name!r} is not a graph beside it)"
    return manifest.path, "the same graph (it names no reference graph)"
