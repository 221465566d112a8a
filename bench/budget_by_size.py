"""Predicted vs measured memory peak of `edge run` on vLLM CPU, across checkpoint sizes (issue 10, item 9).

Writes Qwen3-style checkpoints as header-only safetensors (the data section is
a sparse hole, the way tests/factories.py writes them: every size and offset is
real, the disk cost is kilobytes) with the demo's tokenizer, then runs, one at
a time::

    edge run --model DIR --max-tokens 32 --ignore-eos --json

and prints, per checkpoint, the plan's predicted peak (load path and steady
state), the measured attributable tree-PSS peak from the same record, and
predicted / measured. Every geometry keeps Qwen3-0.6B's attention (28 layers,
8 KV heads of 128, default context 40960), so the KV pool is the same 4,480
MiB at every size and only the weights change.

    python bench/budget_by_size.py --out /tmp/item9                 # all sizes
    python bench/budget_by_size.py --out /tmp/item9 --sizes 0.6b --runs 2
    python bench/budget_by_size.py --out /tmp/item9 --sizes 0.6b-4shards

Only one engine runs at a time; a run on a busy host reads lower (PSS splits
pages shared with other vLLM processes), so repeat a run that looks off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "edge_core" / "demo" / "tiny-llama"
MIB = 1 << 20
#: Extra `edge run` arguments (--edge-arg), e.g. --max-model-len 2048.
EXTRA: list[str] = []

#: name -> (hidden, intermediate, vocab, tie_word_embeddings, shards). Attention is
#: Qwen3-0.6B's everywhere (16 query heads and 8 KV heads of 128, 28 layers).
SIZES: dict[str, tuple[int, int, int, bool, int]] = {
    "150m": (256, 768, 32000, False, 1),         # ~146 MiB
    "640m": (768, 2304, 32000, False, 1),        # ~629 MiB
    "0.6b": (1024, 3072, 151936, False, 1),      # Qwen3-0.6B with its LM head stored: 1,434 MiB
    "0.6b-4shards": (1024, 3072, 151936, False, 4),
    "1.7b": (2048, 6144, 151936, True, 1),       # Qwen3-1.7B geometry, tied: ~3,281 MiB
    "1.7b-2shards": (2048, 6144, 151936, True, 2),
}


def qwen3_config(hidden: int, inter: int, vocab: int, tie: bool) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": inter, "max_position_embeddings": 40960, "max_window_layers": 28,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": tie, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab,
    }


def qwen3_tensors(c: dict) -> dict[str, list[int]]:
    h, hd, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
            p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
        })
    t["model.norm.weight"] = [h]
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = [vocab, h]
    return t


def bf16_header(tensors: dict[str, list[int]]) -> tuple[bytes, int]:
    """A BF16 safetensors file's header (padded to 8 bytes) for ``tensors`` in order, and its data section's bytes."""
    header, off = {}, 0
    for name, shape in tensors.items():
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), off


def write_header_only(path: Path, tensors: dict[str, list[int]]) -> int:
    """A valid BF16 safetensors file whose data section is a hole (as tests/factories.py writes)."""
    raw, off = bf16_header(tensors)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + off)
    return off


def build(out: Path, name: str) -> tuple[Path, int, int]:
    """Write checkpoint ``name`` under ``out``; returns (dir, weight bytes, largest shard bytes)."""
    hidden, inter, vocab, tie, shards = SIZES[name]
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    cfg = qwen3_config(hidden, inter, vocab, tie)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(DEMO / f, d / f)
    tensors = qwen3_tensors(cfg)
    sizes = {k: 2 * math.prod(s) for k, s in tensors.items()}
    total = sum(sizes.values())
    if shards == 1:
        write_header_only(d / "model.safetensors", tensors)
        return d, total, total
    groups: list[dict[str, list[int]]] = [{} for _ in range(shards)]
    running = 0
    for k, s in tensors.items():
        groups[min(shards - 1, running * shards // total)][k] = s
        running += sizes[k]
    weight_map, largest = {}, 0
    for i, g in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        largest = max(largest, write_header_only(d / fname, g))
        weight_map.update({k: fname for k in g})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return d, total, largest


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class TreeBreakdown(threading.Thread):
    """Samples the edge process tree every ``period`` s, split into Pss_Anon and Pss_File (what edge's sampler sums)."""

    def __init__(self, pid: int, period: float = 0.25):
        super().__init__(daemon=True)
        self.period = period
        self.root = psutil.Process(pid)
        self.stop = threading.Event()
        self.samples: list[tuple[float, int, int, int]] = []  # (t, pss, anon, file)
        self.t0_wall = time.time()

    def run(self) -> None:
        t0, self.t0_wall = time.monotonic(), time.time()
        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            tot = {"Pss": 0, "Pss_Anon": 0, "Pss_File": 0}
            for p in procs:
                r = _rollup(p.pid)
                for k in tot:
                    tot[k] += r.get(k, 0)
            self.samples.append((round(time.monotonic() - t0, 2), tot["Pss"], tot["Pss_Anon"], tot["Pss_File"]))
            self.stop.wait(self.period)

    def summary(self) -> dict:
        if not self.samples:
            return {}
        first = self.samples[0]
        top = max(self.samples, key=lambda s: s[1])
        top_file = max(self.samples, key=lambda s: s[3])
        return {"first": first, "peak_pss": top, "peak_file": top_file}


def run_once(edge: str, model: Path, max_tokens: int, period: float = 0.25) -> dict:
    cmd = [edge, "run", "--model", str(model), "--max-tokens", str(max_tokens), "--ignore-eos", "--json", *EXTRA,
           "--engine-log", str(model / "engine.log")]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        sampler = TreeBreakdown(proc.pid, period)
        sampler.start()
        stdout, stderr = proc.communicate()
        sampler.stop.set()
        sampler.join()
    proc.stdout, proc.stderr = stdout, stderr
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rec = json.loads(proc.stdout)
    (model / "last_run.json").write_text(proc.stdout)
    (model / "last_samples.json").write_text(json.dumps({"t0_wall": sampler.t0_wall, "samples": sampler.samples}))
    mem, plan = rec["memory"], rec["plan"]
    from edge_core.budget import Reservation, combine

    terms = [Reservation(**r) for r in plan["reservations"]]
    p = combine(terms, "host_ram")
    return {"wall_s": round(wall, 1), "predicted": mem["predicted_peak_bytes"],
            "load_path": p.load_path_bytes, "steady": p.steady_state_bytes,
            "measured": mem["measured_attributable_bytes"], "ratio": mem["ratio"],
            "terms": {t.purpose: t.bytes for t in terms if t.pool == "host_ram" and not t.headroom},
            "memory": mem, "breakdown": sampler.summary()}


def _fmt(s: tuple) -> str:
    return f"({s[0]}, {s[1] / MIB:,.0f}, {s[2] / MIB:,.0f}, {s[3] / MIB:,.0f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/item9"), help="where the checkpoints go")
    ap.add_argument("--sizes", default="150m,640m,0.6b,1.7b", help=f"comma-separated, of {', '.join(SIZES)} or checkpoint directories")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    ap.add_argument("--edge-arg", action="append", default=[], help="pass to edge run (repeatable)")
    ap.add_argument("--json-out", type=Path, help="also write every record here")
    ap.add_argument("--period", type=float, default=0.25,
                    help="this script's own sampler's period, s (edge's stays 0.25 s): shorter catches more of the "
                    "load's last instant, when the shard mapping and the weights peak together")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    EXTRA[:] = [a for arg in args.edge_arg for a in arg.split()]

    rows = []
    for name in args.sizes.split(","):
        if name in SIZES:
            model, total, largest = build(args.out, name)
        else:  # an existing checkpoint directory, e.g. scripts/make_demo_checkpoints.py --large's
            model = Path(name)
            shards = {f.name: f.stat().st_size for f in model.glob("*.safetensors")}
            total, largest = sum(shards.values()), max(shards.values())
        for i in range(args.runs):
            r = run_once(args.edge, model, args.max_tokens, args.period)
            r.update(size=name, run=i + 1, weights=total, largest_shard=largest)
            rows.append(r)
            print(f"{name:>13} run {i + 1}: weights {total / MIB:,.0f} MiB (largest shard {largest / MIB:,.0f}), "
                  f"predicted {r['predicted'] / MIB:,.0f} MiB (load {r['load_path'] / MIB:,.0f}, "
                  f"steady {r['steady'] / MIB:,.0f}), measured {r['measured'] / MIB:,.0f} MiB, "
                  f"ratio {r['ratio']:.3f}  [{r['wall_s']} s]", flush=True)
            b = r["breakdown"]
            if b:
                print("    tree (t s, pss, anon, file MiB): at peak " + _fmt(b["peak_pss"]) + "; at file peak "
                      + _fmt(b["peak_file"]), flush=True)
            print("    terms (MiB): " + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in r["terms"].items()), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    print("\n| checkpoint | weights | predicted peak | measured tree-PSS | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['weights'] / MIB:,.0f} MiB | {r['predicted'] / MIB:,.0f} MiB | "
              f"{r['measured'] / MIB:,.0f} MiB | **{r['ratio']:.3f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
