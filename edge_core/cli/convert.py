"""``edge import``: a GGUF file (llama.cpp's format) becomes a checkpoint directory vLLM loads.

Parse, call :func:`edge_core.runtime.gguf_import.import_gguf`, render. A file
it cannot convert is a refusal (exit 2, a code and a remedy), an output it
cannot write a usage error (exit 64).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_OK, EXIT_REFUSED, ArtifactError
from ._common import mib, write_document
from .progress import TerminalObserver, say

if TYPE_CHECKING:
    from ..artifact.gguf_map import Conversion


def add_import_command(sub: Any) -> None:
    command = sub.add_parser(
        "import", help="turn a GGUF file (llama.cpp's format) into a checkpoint vLLM loads",
        description=("Read a GGUF file's header, say what it is and the size of the checkpoint it becomes, then "
                     "write safetensors weights in --dtype (every quantized tensor dequantized by gguf-py; the "
                     "Llama family's q/k rows un-permuted as llama.cpp's converter permuted them), config.json, "
                     "generation_config.json, the tokenizer and its chat template. Architectures: llama (and "
                     "Mistral, which GGUF files as llama), qwen2, qwen3; others are refused by name (exit 2). "
                     "Everything is written to a hidden folder beside --out and renamed at the end: a failure or "
                     "Ctrl-C leaves nothing half-written."),
    )
    command.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    command.add_argument("--out", metavar="DIR",
                         help="the checkpoint directory to create (must not exist; default ./<name>-<dtype>)")
    command.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                         help="the weights' dtype (bfloat16: what vLLM CPU runs fastest)")
    command.add_argument("--bits", type=int, choices=(16, 4), default=16,
                         help="16 (default): every weight in --dtype. 4: the decoder's linear layers as W4A16 "
                              "(compressed-tensors, 4-bit integers with a scale and zero point per 32 inputs, which "
                              "vLLM CPU runs): a quarter of the bytes to read per token. From a Q4_0/Q4_1 file the "
                              "file's own 4-bit values are kept; other types are rounded to nearest per group")
    command.add_argument("--json", action="store_true", help="print a JSON document (schema in docs/json.md)")
    command.set_defaults(handler=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    from ..runtime.gguf_import import import_gguf

    observer = TerminalObserver()

    def announce(conversion: Conversion, target: Path) -> None:
        header = conversion.header
        say(f"edge: {Path(header.path).name}: {header.describe()}")
        kind = f"W4A16 (4-bit linear layers, {conversion.dtype} elsewhere)" if conversion.bits == 4 else conversion.dtype
        say(f"edge: writing {mib(conversion.weight_bytes)} of {kind} weights "
            f"({len(conversion.moves)} tensors, {conversion.family.architecture}) and the tokenizer to {target}")

    try:
        result = import_gguf(args.gguf, args.out, dtype=args.dtype, bits=args.bits, observer=observer,
                             on_plan=announce)
    except ArtifactError as exc:
        refusal = {"code": exc.code, "message": exc.message, "remedy": exc.remedy, "path": exc.path}
        if args.json:
            write_document({"outcome": "refused", "refusal": refusal}, "import")
        else:
            print(f"REFUSED: {args.gguf}")
            print(f"  refused   [{exc.code}] {exc.message}")
            print(f"            remedy: {exc.remedy}")
        return EXIT_REFUSED
    if args.json:
        write_document({"outcome": "imported", **result.to_dict()}, "import")
        return EXIT_OK
    kind = "W4A16" if result.bits == 4 else result.dtype
    print(f"imported  {result.out} ({mib(result.weight_bytes)} of {kind} weights, {result.tensors} tensors) "
          f"in {result.seconds:.1f} s")
    print(f"next      edge run --model {result.out}")
    sys.stdout.flush()
    return EXIT_OK
