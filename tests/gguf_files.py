"""GGUF files for tests, written from llama.cpp's format description (docs/gguf.md) with the standard library.

A GGUF header is metadata key/values and one record per tensor; the data
follows, aligned to 32 bytes. :func:`write_gguf` writes one; :func:`quantize_q8_0`,
:func:`quantize_q4_1` and :func:`dequantize_blocks` encode and decode the two
block formats of the demo model's file from their definitions (ggml-common.h):

* Q8_0: blocks of 32; an fp16 scale ``d`` then 32 int8 ``q``: ``x = d * q``.
* Q4_1: blocks of 32; fp16 ``d`` and ``m``, then 16 bytes whose low nibbles
  are elements 0-15 and high nibbles elements 16-31: ``x = d * q + m``.

They are the tests' independent reading of the format: edge's importer uses
gguf-py's decoders, these never call it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
_U32, _I32, _F32, _BOOL, _STR, _ARR, _U64 = 4, 5, 6, 7, 8, 9, 10


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value: Any) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", _BOOL, value)
    if isinstance(value, int):  # counts and ids are uint32 in llama.cpp's files (general.alignment must be)
        if value < 0:
            return struct.pack("<Ii", _I32, value)
        return struct.pack("<II", _U32, value) if value < 2**32 else struct.pack("<IQ", _U64, value)
    if isinstance(value, float):
        return struct.pack("<If", _F32, value)
    if isinstance(value, str):
        return struct.pack("<I", _STR) + _string(value)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return struct.pack("<IIQ", _ARR, _STR, len(value)) + b"".join(_string(v) for v in value)
        return struct.pack("<IIQ", _ARR, _I32, len(value)) + b"".join(struct.pack("<i", v) for v in value)
    raise TypeError(value)


def write_gguf(path: Path, metadata: dict[str, Any], tensors: Sequence[tuple[str, tuple[int, ...], str, bytes]],
               alignment: int = 32) -> Path:
    """Write a GGUF v3 file: ``tensors`` are (name, ggml shape fastest-first, type name, data bytes)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        head += _string(key) + _value(value)
    offset = 0
    infos, blobs = b"", []
    for name, shape, kind, data in tensors:
        infos += _string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        infos += struct.pack("<IQ", TYPE_IDS[kind], offset)
        pad = -len(data) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head += infos
    head += b"\0" * (-len(head) % alignment)
    path.write_bytes(head + b"".join(blobs))
    return path


def quantize_q8_0(values: Sequence[float]) -> bytes:
    out = b""
    for start in range(0, len(values), 32):
        block = values[start:start + 32]
        d = max(abs(v) for v in block) / 127 or 1.0
        d16 = struct.unpack("<e", struct.pack("<e", d))[0]
        out += struct.pack("<e", d16) + bytes((round(v / d16) & 0xFF) for v in block)
    return out


def quantize_q4_1(values: Sequence[float]) -> bytes:
    out = b""
    for start in range(0, len(values), 32):
        block = values[start:start + 32]
        low, high = min(block), max(block)
        d = (high - low) / 15 or 1.0
        d16 = struct.unpack("<e", struct.pack("<e", d))[0]
        m16 = struct.unpack("<e", struct.pack("<e", low))[0]
        q = [min(15, max(0, round((v - m16) / d16))) for v in block]
        out += struct.pack("<ee", d16, m16) + bytes(q[i] | (q[i + 16] << 4) for i in range(16))
    return out


def quantize_q4_0(values: Sequence[float]) -> bytes:
    """Q4_0: blocks of 32; an fp16 scale ``d`` then 16 bytes of nibbles (low: elements 0-15): ``x = d * (q - 8)``."""
    out = b""
    for start in range(0, len(values), 32):
        block = values[start:start + 32]
        extreme = max(block, key=abs)  # as llama.cpp's quantizer: the largest magnitude lands on -8 exactly
        d = extreme / -8 or 1.0
        d16 = struct.unpack("<e", struct.pack("<e", d))[0]
        q = [min(15, max(0, round(v / d16) + 8)) for v in block]
        out += struct.pack("<e", d16) + bytes(q[i] | (q[i + 16] << 4) for i in range(16))
    return out


def dequantize_blocks(data: bytes, kind: str) -> list[float]:
    """Values of Q8_0, Q4_1, F32 or F16 bytes, decoded from the block definitions above."""
    if kind == "F32":
        return list(struct.unpack(f"<{len(data) // 4}f", data))
    if kind == "F16":
        return list(struct.unpack(f"<{len(data) // 2}e", data))
    out: list[float] = []
    if kind == "Q8_0":
        for start in range(0, len(data), 34):
            (d,) = struct.unpack_from("<e", data, start)
            out += [d * q for q in struct.unpack_from("<32b", data, start + 2)]
        return out
    if kind == "Q4_0":
        for start in range(0, len(data), 18):
            (d,) = struct.unpack_from("<e", data, start)
            packed = data[start + 2:start + 18]
            out += [d * ((b & 0x0F) - 8) for b in packed] + [d * ((b >> 4) - 8) for b in packed]
        return out
    if kind == "Q4_1":
        for start in range(0, len(data), 20):
            d, m = struct.unpack_from("<ee", data, start)
            packed = data[start + 4:start + 20]
            out += [d * (b & 0x0F) + m for b in packed] + [d * (b >> 4) + m for b in packed]
        return out
    raise ValueError(kind)


def llama_metadata(arch: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   ffn: int = 128, vocab: int = 32, context: int = 256) -> dict[str, Any]:
    return {
        "general.architecture": arch, "general.name": f"test {arch}", "general.alignment": 32,
        f"{arch}.block_count": layers, f"{arch}.context_length": context, f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": vocab,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }


def llama_tensors(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                  vocab: int = 32, tied: bool = True, seed: int = 0, linear: str = "Q4_1"
                  ) -> list[tuple[str, tuple[int, ...], str, bytes]]:
    """A llama decoder's tensors as llama.cpp names and shapes them (fastest dimension first), Q8_0/Q4_1/F32."""
    import random

    rng = random.Random(seed)
    head_dim = hidden // heads

    def values(n: int) -> list[float]:
        return [rng.uniform(-1, 1) for _ in range(n)]

    def q41(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], str, bytes]:
        encode = {"Q4_1": quantize_q4_1, "Q4_0": quantize_q4_0, "Q8_0": quantize_q8_0}[linear]
        return name, shape, linear, encode(values(shape[0] * shape[1]))

    def f32(name: str, n: int) -> tuple[str, tuple[int, ...], str, bytes]:
        return name, (n,), "F32", struct.pack(f"<{n}f", *values(n))

    out = [("token_embd.weight", (hidden, vocab), "Q8_0", quantize_q8_0(values(hidden * vocab)))]
    for i in range(layers):
        p = f"blk.{i}."
        out += [f32(p + "attn_norm.weight", hidden), q41(p + "attn_q.weight", (hidden, heads * head_dim)),
                q41(p + "attn_k.weight", (hidden, kv_heads * head_dim)),
                q41(p + "attn_v.weight", (hidden, kv_heads * head_dim)),
                q41(p + "attn_output.weight", (heads * head_dim, hidden)), f32(p + "ffn_norm.weight", hidden),
                q41(p + "ffn_gate.weight", (hidden, ffn)), q41(p + "ffn_up.weight", (hidden, ffn)),
                q41(p + "ffn_down.weight", (ffn, hidden))]
    out.append(f32("output_norm.weight", hidden))
    if not tied:
        out.append(q41("output.weight", (hidden, vocab)))
    return out


def permute_qk(rows: Any, heads: int) -> Any:
    """llama.cpp's converter's permutation of q/k rows (HF -> GGUF), as its ``LlamaModel.permute`` writes it."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
