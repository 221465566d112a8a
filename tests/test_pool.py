"""The KV pool as vLLM allocates it (edge_core/plan/pool.py, edge_core/kv.py): blocks, what it guarantees, its size.

Expected figures come from vLLM 0.32's own formulas (v1/core/kv_cache_utils.py) written out here, and from what
vLLM logged on this project's machines (docs/vllm-cpu-facts.md, "The KV pool and auto-fit"), not from the code
under test.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, vllm_block_bytes, write_checkpoint

from edge_core.cli import main
from edge_core.cli.plan import byte_size, context_length
from edge_core.devices import load_device_list
from edge_core.engines.vllm import VLLM_RULES
from edge_core.host import HostFacts
from edge_core.kv import KVPool
from edge_core.plan.kv import estimate_kv, max_model_len_for
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan

DATA = Path(__file__).parent / "data"
GIB, MIB = 1 << 30, 1 << 20
SMOLLM2 = KNOWN_CONFIGS["HuggingFaceTB/SmolLM2-135M-Instruct"]
LLAMA8B = KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]

#: vLLM 0.32 on this project's 2-core VM, SmolLM2-135M-Instruct, bf16, vLLM CPU's block of 128 tokens
#: (docs/vllm-cpu-facts.md, "The KV pool and auto-fit"): ``max_model_len=-1`` with
#: ``kv_cache_memory_bytes=64 MiB`` logged "Auto-fit max_model_len: reduced from 8192 to 2688" and "CPU KV cache
#: size: 2,816 tokens, Maximum concurrency for 2,688 tokens per request: 1.05x" (22 blocks); its own default
#: pool at 8,192 tokens logged "KV cache size: 956,160 tokens, Maximum concurrency for 8,192 tokens per
#: request: 116.72x" (issue 36's note).
VLLM_AUTO_FIT_64MIB = 2688
VLLM_TOKENS_64MIB, VLLM_CONCURRENCY_64MIB, VLLM_BLOCKS_64MIB = 2816, 1.05, 22
VLLM_TOKENS_8192, VLLM_CONCURRENCY_8192 = 956_160, 116.72

#: What `edge plan --model Llama-3.1-8B --devices devices-rtx5090-laptop.json` (no context given: 131,072) named as
#: the context that fits before issue 36, from its refusal's remedy ("--max-model-len 57072 fits (24.0 GiB cuda:0
#: VRAM total)"; edge at cde806d, planned from the list alone).
RTX5090_REMEDY_TOKENS = 57072


def vllm_auto_fit(config: dict, pool_bytes: int, block_size: int) -> int:
    """vLLM's auto-fit for a full-attention model: the longest length whose blocks fit the pool less its null block."""
    block = vllm_block_bytes(config, block_size)
    usable_blocks = (pool_bytes - block) // block  # check_memory = available - _pool_bytes_per_block
    return min(usable_blocks * block_size, config["max_position_embeddings"])


def smollm2_pool(pool_bytes: int, max_model_len: int = 8192, seqs: int = 1) -> KVPool:
    kv = estimate_kv(SMOLLM2, max_model_len=max_model_len, max_num_seqs=seqs, block_size=128)
    pool = kv.with_pool(pool_bytes, "kv_cache_memory", VLLM_RULES).pool
    assert pool is not None
    return pool


# ---------------------------------------------------------------- the pool's arithmetic is vLLM's


def test_a_pool_is_whole_blocks_of_every_layer_less_the_null_block():
    block = vllm_block_bytes(SMOLLM2, 128)
    assert block == 30 * 128 * 2 * 3 * 64 * 2 == 2_949_120
    pool = smollm2_pool(64 * MIB)
    assert pool.block_bytes == block and pool.num_blocks == 64 * MIB // block == 22
    assert pool.blocks_per_sequence == 8192 // 128 and pool.sequence_bytes == 64 * block
    assert pool.min_bytes == 65 * block  # one full-length sequence and the null block: vLLM's least
    assert pool.full_length_sequences == 0  # 22 blocks hold no sequence of 64


def test_vllms_own_default_pool_reads_as_vllm_logged_it():
    # vLLM's default pool here was 7,470 blocks: 956,160 tokens, 116.72x at 8,192 tokens per request.
    pool = smollm2_pool(7470 * vllm_block_bytes(SMOLLM2, 128), seqs=256)
    assert pool.tokens == VLLM_TOKENS_8192 and pool.max_concurrency == VLLM_CONCURRENCY_8192
    assert pool.full_length_sequences == (7470 - 1) // 64 == 116  # the null block is not a sequence's
    assert pool.full_length_sequences < pool.max_num_seqs
    assert "116 sequences of 8,192 tokens at once" in pool.guarantee() and "the rest wait" in pool.guarantee()


def test_the_pool_for_max_num_seqs_is_the_charge_of_that_many_full_sequences():
    kv = estimate_kv(SMOLLM2, max_model_len=8192, max_num_seqs=8, block_size=128)
    block = vllm_block_bytes(SMOLLM2, 128)
    assert kv.bytes_vllm == (8 * 64 + 1) * block
    pool = kv.with_pool(kv.bytes_vllm, "max_num_seqs", VLLM_RULES).pool
    assert pool.full_length_sequences == 8 and "the rest wait" not in pool.guarantee()


def test_auto_fit_on_64_mib_is_what_vllm_logged():
    assert vllm_auto_fit(SMOLLM2, 64 * MIB, 128) == VLLM_AUTO_FIT_64MIB  # the formula agrees with vLLM's run
    assert max_model_len_for(SMOLLM2, 64 * MIB, block_size=128) == VLLM_AUTO_FIT_64MIB
    # ... and the pool at the fitted length reads as vLLM logged it.
    pool = smollm2_pool(64 * MIB, max_model_len=VLLM_AUTO_FIT_64MIB)
    assert (pool.num_blocks, pool.tokens, pool.max_concurrency) == (
        VLLM_BLOCKS_64MIB, VLLM_TOKENS_64MIB, VLLM_CONCURRENCY_64MIB)
    assert pool.full_length_sequences == 1


@pytest.mark.parametrize("pool_mib", [8, 37, 64, 100, 512])
def test_auto_fit_follows_vllms_formula_at_any_pool(pool_mib):
    assert max_model_len_for(SMOLLM2, pool_mib * MIB, block_size=128) == vllm_auto_fit(SMOLLM2, pool_mib * MIB, 128)


def test_a_pool_without_a_block_size_counts_whole_sequences():
    kv = estimate_kv(SMOLLM2, max_model_len=1000, max_num_seqs=4)
    per_sequence = 1000 * 30 * 2 * 3 * 64 * 2
    assert kv.sequence_bytes == per_sequence and kv.block_bytes == 0
    pool = kv.with_pool(3 * per_sequence + 5, "kv_cache_memory", VLLM_RULES).pool
    assert pool.full_length_sequences == 3 and pool.num_blocks == 0 and pool.tokens == 3000


# ---------------------------------------------------------------- what the planner does with it


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    write_checkpoint(root, dict(SMOLLM2), llama_like_tensors(SMOLLM2))
    return root


def plan_on(model, name, **session):
    devices, host_doc = load_device_list(str(DATA / name))
    return make_plan(str(model), session=SessionSpec(**session), devices=devices,
                     host=HostFacts.from_dict(host_doc), devices_source=f"file:{name}")


def test_smollm2_at_256_sequences_of_8192_is_admitted_with_the_largest_pool_that_fits(smollm2):
    # 256 full sequences would take 45 GiB; vLLM needs one and schedules the rest from the pool it has.
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, max_num_seqs=256)
    assert plan.admitted, [r.message for r in plan.refusals]
    kv, block = plan.kv, vllm_block_bytes(SMOLLM2, 128)
    assert kv.bytes_vllm == (256 * 64 + 1) * block > plan.capacity_bytes
    pool = kv.pool
    assert pool.source == "fit" and pool.bytes % block == 0
    assert pool.full_length_sequences == (pool.bytes // block - 1) // 64 >= 1
    assert plan.engine_kwargs["kv_cache_memory_bytes"] == pool.bytes
    assert plan.engine_kwargs["max_num_seqs"] == 256 and plan.engine_kwargs["max_model_len"] == 8192
    kv_term = next(r for r in plan.reservations if r.purpose == "kv_cache")
    assert kv_term.bytes == pool.bytes and "the rest wait" in kv_term.note
    assert plan.peak.admission_bytes <= plan.capacity_bytes
    # One more block would not fit: the pool is the largest.
    from edge_core.plan.pool import admission_with_kv
    assert admission_with_kv(list(plan.reservations), "host_ram", pool.bytes + block) > plan.capacity_bytes


def test_a_pool_that_holds_max_num_seqs_is_taken_as_asked(smollm2):
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, max_num_seqs=8)
    assert plan.admitted and plan.kv.pool.source == "max_num_seqs"
    assert plan.kv.pool.bytes == (8 * 64 + 1) * vllm_block_bytes(SMOLLM2, 128)
    assert plan.kv.pool.full_length_sequences == 8


def test_llama8b_at_64_sequences_of_8192_is_admitted_on_an_h100(llama8b):
    # 64 full sequences would take 64 GiB beside 15 GiB of weights on an 80 GiB card; vLLM serves it from the
    # pool that fits (about 55 GiB as vLLM sizes it there).
    plan = plan_on(llama8b, "devices-h100.json", max_model_len=8192, max_num_seqs=64)
    assert plan.admitted, [r.message for r in plan.refusals]
    block = vllm_block_bytes(LLAMA8B, 16)
    assert block == 32 * 16 * 2 * 8 * 128 * 2
    pool = plan.kv.pool
    assert pool.source == "fit" and pool.bytes % block == 0 and 50 * GIB < pool.bytes < 64 * GIB
    assert 1 <= pool.full_length_sequences < 64
    assert plan.peak.admission_bytes <= plan.capacity_bytes == 80 * GIB


def test_not_one_full_length_sequence_is_refused_with_the_context_auto_fits(llama8b):
    plan = plan_on(llama8b, "devices-rtx5090-laptop.json")  # 131,072 tokens: 16 GiB of KV for one sequence
    assert not plan.admitted
    [refusal] = [r for r in plan.refusals if r.device_id == "cuda:0"]
    assert refusal.code == "budget_exceeds_device" and "not even one sequence of 131,072 tokens fits" in refusal.message
    assert refusal.details["max_model_len_that_fits"] == RTX5090_REMEDY_TOKENS
    assert "--max-model-len auto" in refusal.remedy and f"{RTX5090_REMEDY_TOKENS:,} tokens" in refusal.remedy


def test_auto_admits_llama8b_on_the_laptop_at_the_context_the_remedy_named(llama8b):
    plan = plan_on(llama8b, "devices-rtx5090-laptop.json", max_model_len_auto=True)
    assert plan.admitted, [r.message for r in plan.refusals]
    assert plan.session.max_model_len == RTX5090_REMEDY_TOKENS and plan.session.max_model_len_auto
    assert plan.engine_kwargs["max_model_len"] == RTX5090_REMEDY_TOKENS
    assert plan.kv.pool.full_length_sequences == 1
    assert any("--max-model-len auto" in note for note in plan.notes)


def test_auto_keeps_the_models_own_context_where_one_sequence_of_it_fits(smollm2):
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len_auto=True)
    assert plan.admitted and plan.session.max_model_len == 8192


def test_auto_fits_the_context_to_a_given_pool_as_vllm_does(smollm2):
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len_auto=True, kv_cache_memory_bytes=64 * MIB)
    assert plan.admitted
    assert plan.session.max_model_len == VLLM_AUTO_FIT_64MIB
    assert plan.engine_kwargs["kv_cache_memory_bytes"] == 64 * MIB
    assert plan.engine_kwargs["max_model_len"] == VLLM_AUTO_FIT_64MIB
    assert plan.kv.pool.source == "kv_cache_memory" and plan.kv.pool.full_length_sequences == 1


def test_a_pool_that_holds_no_full_length_sequence_is_refused_as_vllm_would(smollm2):
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, kv_cache_memory_bytes=64 * MIB)
    assert not plan.admitted
    [refusal] = plan.refusals
    assert refusal.code == "budget_exceeds_device" and "holds no sequence of 8,192 tokens" in refusal.message
    assert refusal.details["max_model_len_that_fits"] == VLLM_AUTO_FIT_64MIB
    assert refusal.details["min_kv_cache_memory_bytes"] == 65 * vllm_block_bytes(SMOLLM2, 128)
    least_mib = -(-65 * vllm_block_bytes(SMOLLM2, 128) // MIB)  # 182.8 MiB, rounded up
    assert "--max-model-len auto" in refusal.remedy and f"--kv-cache-memory {least_mib}MiB or more" in refusal.remedy


def test_a_given_pool_too_big_for_the_device_names_the_pool_that_fits(smollm2):
    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, kv_cache_memory_bytes=64 * GIB)
    assert not plan.admitted
    [refusal] = plan.refusals
    fits = refusal.details["kv_cache_memory_that_fits"]
    assert refusal.code == "budget_exceeds_device" and 0 < fits < 32 * GIB
    assert f"--kv-cache-memory {fits >> 20}MiB fits" in refusal.remedy
    again = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, kv_cache_memory_bytes=(fits >> 20) << 20)
    assert again.admitted  # the remedy, applied, is admitted


def test_a_server_promises_what_the_largest_pool_holds(smollm2):
    from edge_core.plan.concurrency import full_context_sequences

    plan = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, max_num_seqs=8)
    fit = full_context_sequences(plan)
    assert fit > 8
    block = vllm_block_bytes(SMOLLM2, 128)
    holding = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, max_num_seqs=8,
                      kv_cache_memory_bytes=(fit * 64 + 1) * block)
    assert holding.admitted and holding.kv.pool.full_length_sequences == fit
    one_more = plan_on(smollm2, "devices-cpu-32g.json", max_model_len=8192, max_num_seqs=8,
                       kv_cache_memory_bytes=((fit + 1) * 64 + 1) * block)
    assert not one_more.admitted


def test_the_plan_document_states_the_pool(smollm2, capsys):
    assert main(["plan", "--model", str(smollm2), "--devices", str(DATA / "devices-cpu-32g.json"),
                 "--max-num-seqs", "256", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    pool = doc["kv"]["pool"]
    assert pool["source"] == "fit" and pool["bytes"] == doc["engine_kwargs"]["kv_cache_memory_bytes"]
    assert {"num_blocks", "blocks_per_sequence", "full_length_sequences", "tokens", "max_concurrency",
            "guarantee", "min_bytes"} <= set(pool)
    assert doc["session"]["max_model_len_auto"] is False and doc["session"]["kv_cache_memory_bytes"] is None
    assert main(["plan", "--model", str(smollm2), "--devices", str(DATA / "devices-cpu-32g.json"),
                 "--max-num-seqs", "256"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"kv        pool [\d,]+ MiB \(the largest that fits", out), out
    assert "sequences of 8,192 tokens at once" in out and "the rest wait" in out


# ---------------------------------------------------------------- the flags


@pytest.mark.parametrize(("text", "value"), [
    ("67108864", 64 * MIB), ("64MiB", 64 * MIB), ("64mib", 64 * MIB), ("2GiB", 2 * GIB), ("2G", 2 * GIB),
    ("1.5GB", 1_500_000_000), ("512 KiB", 512 << 10),
])
def test_kv_cache_memory_takes_bytes_or_a_unit(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "64 parsecs", "-1", "0", "0.1", "MiB", "1e9"])
def test_a_size_that_is_not_one_is_a_usage_error(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_max_model_len_takes_auto_or_a_number():
    assert context_length("auto") == "auto" and context_length("AUTO") == "auto" and context_length("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        context_length("0")


@pytest.mark.parametrize("command", ["plan", "run", "chat", "serve", "accept", "parity"])
def test_every_planning_command_takes_the_pool_and_auto(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-memory SIZE" in out and "--max-model-len N|auto" in out
