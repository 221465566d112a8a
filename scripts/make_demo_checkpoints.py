"""Write the random-weight Llama checkpoints edge's tests and demos run against.

Why these exist: edge must be exercised end to end (manifest -> plan -> a real
vLLM CPU engine) without a model hub. Three shapes cover what matters:

* ``edge_core/demo/tiny-llama`` head_dim 32, a size vLLM CPU's attention supports,
                           so the engine starts and generates (committed, 1.8 MB).
* ``edge_core/demo/tiny-llama-hd16`` head_dim 16: vLLM CPU loads it and then fails in the
                           first forward pass, the crash edge refuses before load.
* ``--large OUT_DIR``      0.62 GiB of bf16 weights in several shards behind
                           ``model.safetensors.index.json``, for memory-budget
                           checks (not committed).

Output is byte-identical across runs (fixed seeds, sorted JSON, a hand-written
safetensors writer), so a changed digest means a changed generator.

    python scripts/make_demo_checkpoints.py              # writes edge_core/demo/ dirs
    python scripts/make_demo_checkpoints.py --large /tmp/edge-large-llama
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

# Original text, written for this script, so the tokenizer's training data is
# ours and fixed. Its content only shapes the merges; the weights are random.
CORPUS = """\
The gateway box sits in a cupboard next to the router. It has no graphics card,
only a processor with eight cores and thirty two gigabytes of memory. Every
morning it reads the overnight logs, writes a short summary, and sends it to the
people who look after the building. The model it runs is small, and that is fine:
the work is simple, the answers are short, and nobody wants to wait for a cloud.

Before anyone loads a model, someone should ask a plain question. Which device
can run this checkpoint, and how many bytes will it take? The weights are easy to
count. The cache for keys and values grows with the context length, the number of
layers, the number of key and value heads, and the size of each head. The runtime
itself costs memory too, because every worker process imports its own libraries.

When the answer is no, the tool says why and what to do. A head size the kernel
does not support is a refusal, not a crash after a long load. A model too large
for the memory is a refusal with the longest context that would still fit. A
format the device cannot execute names the build that could run it.

A laptop has a discrete card, an integrated graphics unit, and a neural engine.
The card has its own memory. The other two share memory with the processor, so
their capacity is taken from the same pool and never counted three times.

Tokens arrive one at a time. Each event carries only the new text, a sequence
number so that loss can be seen, and an epoch so that a cancelled request can be
retired cleanly. A full queue makes the producer wait. Cancelling first retires
the epoch, then aborts the request, then closes the stream.

Numbers without a source are guesses. A value read from a file is detected, a
value the backend produced by running something is measured, and everything else
is an estimate. Peaks are sampled every quarter of a second, so every peak is a
lower bound, and the record says so.
"""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
TOKENIZER_VOCAB = 1024


def build_tokenizer():
    """Byte-level BPE trained on CORPUS; byte-level so no input is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # Prepend <s> the way Llama tokenizers do, so prompts carry a BOS token.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bf16 by keeping the upper 16 bits (truncation; fine for noise)."""
    u32 = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return (u32 >> 16).astype("<u2").tobytes()


def llama_tensors(cfg: dict):
    """Yield (name, shape) of a LlamaForCausalLM in HF naming, in a fixed order."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (cfg["vocab_size"], h)


def tensor_bytes(name: str, shape: tuple, rng: np.random.Generator) -> bytes:
    if name.endswith("norm.weight"):
        # RMSNorm gains of 1: random gains would only add noise to noise.
        return bf16_bytes(np.ones(shape, dtype=np.float32))
    return bf16_bytes(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))


def write_safetensors(path: Path, tensors: list[tuple[str, tuple, bytes]]) -> None:
    """Write the safetensors layout directly: u64 header length, JSON, raw data.

    Written by hand because numpy has no bf16 and the torch writer is not
    needed for this; offsets follow tensor order, header padded to 8 bytes.
    """
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, data in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    hj = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, _, data in tensors:
            f.write(data)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def llama_config(*, hidden, layers, heads, kv_heads, inter, vocab, max_pos=2048) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
    }


#: The demo's chat template: one "<|role|>\ncontent" block per message, then the assistant's tag.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_checkpoint(out: Path, cfg: dict, tok, *, seed: int, shard_bytes: int | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.index.json")):
        stale.unlink()
    write_json(out / "config.json", cfg)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
    )
    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": cfg["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            # A plain role-tagged template, so `edge serve` answers /v1/chat/completions too.
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    )

    rng = np.random.default_rng(seed)
    specs = list(llama_tensors(cfg))
    if shard_bytes is None:
        write_safetensors(out / "model.safetensors", [(n, s, tensor_bytes(n, s, rng)) for n, s in specs])
        return

    # Shard greedily in tensor order; one shard is built in memory at a time.
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 2 * int(np.prod(shape))
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = [(n, s, tensor_bytes(n, s, rng)) for n, s in group]
        write_safetensors(out / fname, tensors)
        for n, _, data in tensors:
            weight_map[n] = fname
            total += len(data)
        del tensors
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def padded_vocab(tok, multiple: int = 64) -> int:
    n = tok.get_vocab_size()
    return -(-n // multiple) * multiple


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", type=Path, default=REPO / "edge_core" / "demo", help="where tiny-llama*/ go")
    ap.add_argument("--large", type=Path, metavar="OUT_DIR", help="write only the large sharded checkpoint here")
    args = ap.parse_args(argv)

    tok = build_tokenizer()
    # The model's vocab may exceed the tokenizer's (vLLM accepts padded rows);
    # rounding up to 64 mirrors how real checkpoints pad their embeddings.
    vocab = padded_vocab(tok)

    if args.large:
        # hidden 1024, 16 layers, MHA 16x64, intermediate 4096, vocab 32000:
        # 334M params, 668 MB (637 MiB) bf16, in ~200 MB shards so sharding is exercised.
        cfg = llama_config(hidden=1024, layers=16, heads=16, kv_heads=16, inter=4096, vocab=32000)
        write_checkpoint(args.large, cfg, tok, seed=2, shard_bytes=200 * 10**6)
        print(f"{args.large}  sha256(all files)={digest(args.large)}")
        return 0

    runnable = llama_config(hidden=128, layers=4, heads=4, kv_heads=2, inter=384, vocab=vocab)
    hd16 = llama_config(hidden=128, layers=4, heads=8, kv_heads=2, inter=384, vocab=vocab)
    for name, cfg, seed in (("tiny-llama", runnable, 0), ("tiny-llama-hd16", hd16, 1)):
        out = args.demo_dir / name
        write_checkpoint(out, cfg, tok, seed=seed, shard_bytes=None)
        print(f"{out}  head_dim={cfg['head_dim']}  sha256(all files)={digest(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
