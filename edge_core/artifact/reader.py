"""What is this model path — a checkpoint directory or an exported graph — read without loading a weight.

:func:`read_manifest` is the one entry: it dispatches to the checkpoint
reader (:mod:`.checkpoint`) or the ONNX graph reader (:mod:`.graph`) and keeps
the promise that any bad input becomes an :class:`~edge_core.errors.ArtifactError`
with a code the planner reports (``config_unreadable`` or ``artifact_invalid``),
never a traceback.
"""

from __future__ import annotations

import os
import shlex

from ..errors import ArtifactError
from ..manifest import Manifest
from ._files import listdir
from .checkpoint import INDEX_NAME, read_checkpoint
from .gguf import is_gguf

#: The vLLM release whose missing GGUF loader the refusal of a GGUF file names (GGUF left vLLM's core for a
#: separate CUDA-only plugin).
VLLM_WITHOUT_GGUF = "0.32"
#: Appears in a refusal only when input reached a case no check anticipated.
INTERNAL_MARK = "unanticipated input (an edge bug)"


def read_manifest(path: str | os.PathLike[str], digest_weights: bool = False) -> Manifest:
    """Read a checkpoint directory, a ``.onnx`` file, or a directory holding one graph.

    Raises :class:`ArtifactError` (and nothing else) for any input that cannot be
    read safely; ``digest_weights`` streams every weight byte through sha256.
    """
    try:
        root = os.path.abspath(os.fspath(path))
    except (TypeError, ValueError) as exc:
        raise ArtifactError("artifact_invalid", f"{path!r} is not a usable path: {exc}",
                            "pass the path of a model directory", None) from None
    try:
        return _read(root, digest_weights)
    except ArtifactError:
        raise
    except RecursionError:
        raise ArtifactError("artifact_invalid", f"{root}: a file nests structures too deeply to read",
                            "re-export the model with a standard tool", root) from None
    except (OSError, ValueError) as exc:
        # The named checks cover the known cases; this keeps the promise that
        # no input ends in a traceback (e.g. a file vanishing mid-read).
        raise ArtifactError("artifact_invalid", f"{root}: could not be read: {exc}",
                            "check the files are complete and readable", root) from None
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        # A shape of input no check anticipated: still a refusal, but marked
        # as edge's own gap so it gets reported (the property tests look for it).
        raise ArtifactError("artifact_invalid", f"{root}: {INTERNAL_MARK} while reading: "
                            f"{type(exc).__name__}: {exc}",
                            "report this to edge's maintainers with the file that caused it", root) from None


def missing_path(root: str) -> ArtifactError:
    """The refusal for a model path that does not exist: what of it does, and a remedy for what it names."""
    existing = os.path.dirname(os.path.abspath(root))
    while existing and not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    where = f" (the nearest folder that exists is {existing})" if existing not in ("", os.sep) else ""
    if root.lower().endswith(".onnx"):
        remedy = ("check the path; an ONNX stage of a checkpoint is exported with `python scripts/export_stage.py` "
                  "and planned as `edge plan --model STAGE.onnx`")
    else:
        remedy = ("check the path; for a model on the Hugging Face Hub pass its id (org/name), which edge plans "
                  "without downloading, or download it first (`hf download ORG/NAME --local-dir DIR`) and pass DIR")
    return ArtifactError("artifact_invalid", f"{root} does not exist{where}", remedy, root)


def gguf_refusal(root: str) -> ArtifactError:
    """A GGUF file is not a checkpoint vLLM loads: what it is, and the `edge import` line that makes it one."""
    from .gguf import read_gguf_header
    from .gguf_map import plan_conversion

    header = read_gguf_header(root)  # a malformed file is refused as artifact_invalid here
    conversion = plan_conversion(header)  # an architecture or tensor type import cannot take, refused here
    return ArtifactError(
        "gguf_needs_import",
        f"{root} is a GGUF file (llama.cpp's format: {header.describe()}); vLLM {VLLM_WITHOUT_GGUF} has no GGUF "
        "loader: it runs the checkpoint `edge import` makes of it",
        f"edge import {shlex.quote(root)} --out DIR (writes a {conversion.weight_bytes / 2**20:,.0f} MiB "
        f"{conversion.dtype} checkpoint), then --model DIR", root)


def _read(root: str, digest_weights: bool) -> Manifest:
    if os.path.isfile(root):
        if root.lower().endswith(".onnx"):
            from .graph import read_graph_manifest  # loaded for graphs only, like onnx itself

            return read_graph_manifest(os.path.dirname(root), os.path.basename(root), digest_weights)
        if root.lower().endswith(".gguf") or is_gguf(root):
            raise gguf_refusal(root)
        raise ArtifactError("artifact_invalid", f"{root} is a file, not a model directory",
                            "pass the directory that holds config.json and the *.safetensors files, or a .onnx graph",
                            root)
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ArtifactError("artifact_invalid", f"{root} is neither a regular file nor a directory",
                            "pass the model directory or a .onnx file", root)
    if not os.path.isdir(root):
        raise missing_path(root)
    names = listdir(root)
    has_safetensors = INDEX_NAME in names or any(n.endswith(".safetensors") for n in names)
    graphs = sorted(n for n in names if n.lower().endswith(".onnx"))
    if not has_safetensors and graphs:
        if len(graphs) > 1:
            raise ArtifactError("artifact_invalid", f"{root} holds {len(graphs)} ONNX graphs ({', '.join(graphs)})",
                                "pass the one .onnx file to plan for", root)
        from .graph import read_graph_manifest

        return read_graph_manifest(root, graphs[0], digest_weights)
    return read_checkpoint(root, names, has_safetensors, digest_weights)

