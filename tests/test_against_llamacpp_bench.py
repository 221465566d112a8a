"""bench/against_llamacpp.py's parts that turn what the runs printed into the table's figures.

No engine and no llama.cpp: the records are what the bench's jobs write, built here; the prompt fitting runs
on the bundled tiny-llama's real tokenizer and chat template.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "against_llamacpp.py"
_spec = importlib.util.spec_from_file_location("against_llamacpp", BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["against_llamacpp"] = bench
_spec.loader.exec_module(bench)

MIB = 1 << 20


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_the_first():
    # 5 tokens, the first at 1.0 s, one every 0.25 s after it: 4 tokens in 1.0 s.
    assert bench.decode_rate([1.0, 1.25, 1.5, 1.75, 2.0]) == pytest.approx(4.0)
    assert bench.decode_rate([3.0]) is None
    assert bench.decode_rate([]) is None


def test_edge_first_token_is_when_the_engine_was_up_plus_its_own_time_to_first_token():
    doc = {"timings": {"time_to_first_token_s": 0.5, "engine_start_s": 30.0}}
    assert bench.edge_first_token_s(31.25, doc) == pytest.approx(31.75)
    assert bench.edge_first_token_s(None, doc) is None
    assert bench.edge_first_token_s(31.25, {"timings": {}}) is None


def test_the_llama_child_marks_are_read_back():
    lines = ["noise from a library\n", "LOADED 12.5\n", "FIRST 13.0\n",
             "RESULT " + json.dumps({"tokens": 3, "decode_tok_s": 40.0}) + "\n"]
    marks = bench.parse_marks(lines)
    assert marks["loaded"] == 12.5 and marks["first"] == 13.0
    assert marks["result"] == {"tokens": 3, "decode_tok_s": 40.0}


def test_streams_rate_is_every_completion_token_over_the_wall_from_first_request_to_last_answer():
    results = [{"start": 10.0 + i * 0.01, "end": 18.0 - i * 0.1, "tokens": 128} for i in range(8)]
    # 1,024 tokens between 10.0 (the first sent) and 18.0 (the last answer).
    assert bench.streams_rate(results) == pytest.approx(1024 / 8.0)
    results[3] = {"start": 10.03, "end": 11.0, "status": 500, "tokens": None}
    assert bench.streams_rate(results) is None  # a failed stream voids the figure


def test_agreement_and_perplexity():
    assert bench.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 1.0)
    assert bench.agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (1, 0.75)
    # Every token at log-probability ln(1/4): perplexity 4.
    assert bench.perplexity([math.log(0.25)] * 10) == pytest.approx(4.0)


def _run(model: str, subject: str, job: str, **fields: float) -> dict:
    return {"kind": "run", "model": model, "subject": subject, "job": job, "outcome": "ok", **fields}


def test_the_table_holds_each_columns_median_and_edge_over_llamacpp():
    rows = [{"kind": "host", "date": "2026-12-07", "cpu": "x", "cores": 2, "isa": ["amx_tile"], "commit": "abc"}]
    for first, decode, pss in ((1.0, 70.0, 400 * MIB), (1.2, 80.0, 420 * MIB), (0.9, 75.0, 410 * MIB)):
        rows.append(_run("smollm2", "llamacpp", "short", first_token_s=first, decode_tok_s=decode,
                         tree_pss_peak_bytes=pss))
    for first, decode, pss in ((20.0, 35.0, 1800 * MIB), (22.0, 40.0, 1900 * MIB), (21.0, 30.0, 1850 * MIB)):
        rows.append(_run("smollm2", "edge-w4a16", "short", first_token_s=first, decode_tok_s=decode,
                         tree_pss_peak_bytes=pss))
    rows.append(_run("smollm2", "edge-w4a16", "short", first_token_s=1.0, decode_tok_s=1000.0,
                     tree_pss_peak_bytes=1) | {"outcome": "failed"})  # never counted
    rows.append({"kind": "least_limit", "model": "smollm2", "subject": "llamacpp", "least_limit_bytes": 256 * MIB})
    rows.append({"kind": "least_limit", "model": "smollm2", "subject": "edge-w4a16", "least_limit_bytes": 1536 * MIB})
    cells = bench.summarize(rows)
    assert cells[("smollm2", "llamacpp")]["decode_tok_s"] == 75.0
    assert cells[("smollm2", "edge-w4a16")]["decode_tok_s"] == 35.0
    assert cells[("smollm2", "edge-w4a16")]["decode_tok_s_n"] == 3
    table = bench.report_table(rows)
    ratio_row = next(line for line in table.splitlines() if "edge-w4a16 / llama.cpp" in line)
    cells_text = [c.strip() for c in ratio_row.strip("|").split("|")]
    # start 21.0 / 1.0, decode 35 / 75, no prefill, PSS 1850 / 410, limit 1536 / 256, no streams.
    assert cells_text[2:] == [f"{21.0:.2f}", f"{35 / 75:.2f}", "-", f"{1850 / 410:.2f}", f"{1536 / 256:.2f}", "-"]


@pytest.mark.slow  # transformers' import: ~7 s on two busy cores
def test_the_long_prompt_is_the_longest_head_of_the_passage_that_fits():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(Path(bench.REPO) / "edge_core" / "demo" / "tiny-llama")
    text, ids = bench.long_prompt(tok, budget=200)
    assert len(ids) <= 200
    assert ids == bench.chat_ids(tok, text)
    words = bench.PASSAGE.split(" ")
    used = len(text[len(bench.PREFILL_ASK):].split(" "))
    longer = bench.PREFILL_ASK + " ".join(words[: used + 1])
    assert len(bench.chat_ids(tok, longer)) > 200
