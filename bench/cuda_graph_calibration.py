"""edge-cuda's CUDA graph terms against the graph memory vLLM users published: predicted / published per log.

Each point is one published vLLM log line ("Graph capturing finished in N secs,
took X GiB", "Estimated CUDA graph memory: X GiB total", or a measured private
pool), with the model's geometry and the graphs that run captured (from the same
log's "Profiling CUDA graph memory: PIECEWISE=n (largest=m), FULL=k" or its
capture-size list). The prediction is edge-cuda's own formula
(``edge_cuda._graphs.graph_pool_bytes``) on that geometry; docs/vllm-cuda-facts.md
carries the table this prints, with the citations.

    python bench/cuda_graph_calibration.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "edge_cuda"))

from edge_cuda._graphs import GraphSet, graph_pool_bytes  # noqa: E402

GIB = 1 << 30


def grid(top: int) -> tuple[int, ...]:
    """vLLM's capture grid up to ``top``: 1, 2, 4, every 8 below 256, every 16 above (``config/vllm.py``)."""
    sizes = [i for i in (1, 2, 4) if i <= top] + list(range(8, min(top + 1, 256), 8))
    return tuple(sizes + (list(range(256, top + 1, 16)) if top >= 256 else []))


#: (label, url, model, gpu, vllm, layers, hidden, dtype bytes, PIECEWISE sizes, FULL sizes, published GiB, what).
POINTS = [
    ("llama32-1b-v0", "https://github.com/vllm-project/vllm/pull/11349", "meta-llama/Llama-3.2-1B-Instruct",
     "not named", "0.6.5.dev (V0)", 16, 2048, 2, (), grid(256), 0.21, "took"),
    ("llama3-70b-awq-tp8-v0", "https://github.com/vllm-project/vllm/pull/5515", "Llama-3-70B-Instruct-AWQ, TP 8",
     "not named (Ray, 8 GPUs)", "0.5.0.dev (V0)", 80, 8192, 2, (), grid(256), 0.6172, "took"),
    ("qwen3-8b", "https://github.com/LMCache/LMCache/issues/3430", "Qwen/Qwen3-8B", "24 GB GPU",
     ">= 0.21 (estimate on by default)", 36, 4096, 2, grid(512), grid(256), 0.52, "estimated"),
    ("qwen36-27b-tp2-16", "https://github.com/noonghunna/club-3090/issues/104", "Qwen3.6-27B AutoRound, TP 2",
     "2x RTX 3090", "0.2x (estimate on by default)", 64, 5120, 2, grid(16), (), 0.13, "estimated"),
    ("qwen36-27b-tp4-32", "https://github.com/noonghunna/club-3090/pull/44", "Qwen3.6-27B, TP 4", "4x RTX 3090",
     "0.2x (estimate on by default)", 64, 5120, 2, grid(32), (), 0.17, "estimated"),
    ("qwen36-27b-tp2-3+2", "https://github.com/noonghunna/club-3090/issues/434", "Qwen3.6-27B, TP 2, LMCache",
     "2x RTX 3090 (NVLink)", "0.2x (estimate on by default)", 64, 5120, 2, (4, 8, 16), (4, 8), 0.09, "estimated"),
    ("mixtral-awq-full12", "https://github.com/pie-project/pie/pull/348", "Mixtral-8x7B-Instruct-v0.1-AWQ",
     "A100-SXM4-80GB", "pie's vLLM driver (2026-05)", 32, 4096, 2, (), grid(96)[:12], 90 / 1024, "graph memory"),
    ("gpt-oss-120b-tp8", "https://github.com/vllm-project/vllm/pull/51590", "openai/gpt-oss-120b MXFP4, TP 8",
     "8x RTX PRO 4500 Blackwell (sm_120)", "0.28.0", 36, 2880, 2, grid(512), grid(256), 62 / 1024,
     "private pool at OOM"),
]

#: The window the issue asks predictions to land in.
LOW, HIGH = 0.9, 1.3


def rows() -> list[dict]:
    out = []
    for label, url, model, gpu, vllm, layers, hidden, width, pw, full, published, what in POINTS:
        pool = graph_pool_bytes(GraphSet(piecewise=tuple(pw), full=tuple(full)), layers=layers, hidden_size=hidden,
                                dtype_bytes=width)
        predicted = pool.total_bytes / GIB
        out.append({"label": label, "url": url, "model": model, "gpu": gpu, "vllm": vllm, "layers": layers,
                    "hidden": hidden, "piecewise": len(pw), "full": len(full), "published_gib": round(published, 3),
                    "figure": what, "predicted_gib": round(predicted, 3), "ratio": round(predicted / published, 2),
                    "in_window": LOW <= predicted / published <= HIGH})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print("| model | GPU | vLLM | graphs (PIECEWISE / FULL) | published | predicted | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        mark = "" if r["in_window"] else " (outside)"
        print(f"| {r['model']} | {r['gpu']} | {r['vllm']} | {r['piecewise']} / {r['full']} | "
              f"{r['published_gib']:.3f} GiB ({r['figure']}) | {r['predicted_gib']:.3f} GiB | {r['ratio']:.2f}{mark} |")
    inside = sum(r["in_window"] for r in table)
    print(f"\n{inside} of {len(table)} in [{LOW}, {HIGH}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
