"""The packing levers as they act in a real vLLM CPU worker, read from inside it (edge_cpu/_packing.py's probe).

One engine per configuration, each in a child process that starts ``vllm.LLM``
in one process (the layout ``edge run`` plans for one CPU rank) on a tiny
header-only checkpoint (``load_format="dummy"``: vLLM's seeded random
weights), runs 8 greedy tokens, asks the worker for :func:`edge_cpu._packing.probe`
through ``collective_rpc`` and prints it: a tied Llama in an engine edge
starts (its engine mark set, every lever on), the same as plain vLLM in this
edge-cpu venv (no mark, every lever's switch left on: the plugins must change
nothing), the same engine of edge's with only ``EDGE_CPU_SHARED_TABLE=0``, and
an untied Llama with the levers on. The tables are 8,192 x 256 bf16 (4 MiB:
packed by oneDNN).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from factories import llama_like_tensors, tiny_config, write_checkpoint

#: The bundled demo's tokenizer, which the checkpoints here borrow.
DEMO = Path(__file__).resolve().parents[3] / "edge_core" / "demo" / "tiny-llama"
NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.engine(starts=4),  # the module's four probes: tied on, tied off, tied without the shared table, untied
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
]

CHILD = """
import json, os, sys
from edge_core.runtime.env import apply_runtime_env
apply_runtime_env(edge_engine=sys.argv[2] == "edge", layout_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function: this test's probe
from vllm import LLM, SamplingParams
from edge_cpu._packing import probe
llm = LLM(model=sys.argv[1], load_format="dummy", max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256,
          enforce_eager=True, kv_cache_memory_bytes=8 << 20, dtype="bfloat16", seed=0,
          distributed_executor_backend="uni")
out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False),
                   use_tqdm=False)
found = llm.collective_rpc(probe)[0]
found["token_ids"] = list(out[0].outputs[0].token_ids)
print("PROBE " + json.dumps(found), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def packed_gemm_here() -> bool:
    """The plan's question (edge_cpu._packing.host_has_packed_gemm, from /proc/cpuinfo) for this host."""
    from edge_core.host import read_host
    from edge_cpu._packing import host_has_packed_gemm

    host = read_host()
    return host_has_packed_gemm(host.isa_flags, host.machine)


def engine_probe(tmp_path_factory, tied: bool, env: dict[str, str], side: str = "edge") -> dict:
    config = tiny_config(vocab_size=8192, tie_word_embeddings=tied, num_hidden_layers=2)
    model = write_checkpoint(tmp_path_factory.mktemp("tied" if tied else "untied"), config,
                             llama_like_tensors(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / name, model / name)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_CPU_")} | env
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), side], capture_output=True, text=True,
                          timeout=600, env=environ, stdin=subprocess.DEVNULL)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("PROBE ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    return json.loads(line[6:])


@pytest.fixture(scope="module")
def tied_on(tmp_path_factory):
    return engine_probe(tmp_path_factory, tied=True, env={})


@pytest.fixture(scope="module")
def tied_plain(tmp_path_factory):
    """Plain vLLM in this edge-cpu venv: no engine mark, every lever's switch left as a user's shell has it (on)."""
    return engine_probe(tmp_path_factory, tied=True, env={}, side="plain")


@pytest.fixture(scope="module")
def tied_shared_off(tmp_path_factory):
    return engine_probe(tmp_path_factory, tied=True, env={"EDGE_CPU_SHARED_TABLE": "0"})


@pytest.fixture(scope="module")
def untied_on(tmp_path_factory):
    return engine_probe(tmp_path_factory, tied=False, env={})


def by_class(found: dict) -> dict[str, dict]:
    return {table["class"]: table for table in found["tables"]}


def test_levers_on_the_tied_table_is_held_once_packed_for_both_modules(tied_on):
    if not packed_gemm_here():
        pytest.skip("this host has no AVX-512 BF16, so vLLM CPU loads a build without sgl-kernel's packed GEMM: "
                    "test_levers_on_without_the_packed_gemm_the_tied_head_is_packed_as_vllm_does runs instead")
    tables = by_class(tied_on)
    embed, head = tables["VocabParallelEmbedding"], tables["ParallelLMHead"]
    assert embed["weight_ptr"] == head["weight_ptr"]  # tied: one table, re-laid out in place
    assert (embed["role"], head["role"]) == ("gather", "tied_head")
    assert not embed["packed"] and not head["packed"] and head["shared_packed"]  # no oneDNN copy of it
    assert tied_on["counts"]["tables_shared_packed"] == 1 and tied_on["counts"]["tied_heads_packed_apart"] == 0
    assert tied_on["counts"]["tables_deferred"] == 1
    assert tied_on["counts"]["tables_packed_on_use"] == 0  # Llama's logits come from the head, never the embedding


def test_levers_on_without_the_packed_gemm_the_tied_head_is_packed_as_vllm_does(tied_on):
    if packed_gemm_here():
        pytest.skip("this host has AVX-512 BF16 and vLLM's packed GEMM: the tied table is packed in place "
                    "(test_levers_on_the_tied_table_is_held_once_packed_for_both_modules); the fallback is forced "
                    "hermetically in test_packing.py")
    tables = by_class(tied_on)
    embed, head = tables["VocabParallelEmbedding"], tables["ParallelLMHead"]
    assert head["packed"] and not head["shared_packed"] and not embed["packed"]  # vLLM's one copy, the head's
    assert tied_on["counts"]["tied_heads_packed_apart"] == 1 and tied_on["counts"]["tables_shared_packed"] == 0


def test_without_the_shared_table_the_tied_head_packs_its_own_copy(tied_shared_off, tied_on):
    tables = by_class(tied_shared_off)
    embed, head = tables["VocabParallelEmbedding"], tables["ParallelLMHead"]
    assert head["packed"] and not head["shared_packed"] and not embed["packed"]
    assert tied_shared_off["counts"]["tables_shared_packed"] == 0
    assert tied_shared_off["levers"] == {"EDGE_CPU_ONE_TABLE": True, "EDGE_CPU_SHARED_TABLE": False,
                                         "EDGE_CPU_REPACK_TRIM": True, "EDGE_CPU_INT8_HEAD": True}
    # a float checkpoint: the int8 head does not apply, whatever its switch says
    assert not head["shared_int8"] and tied_shared_off["counts"]["tables_shared_int8"] == 0
    assert tied_shared_off["token_ids"] == tied_on["token_ids"]


def test_levers_on_the_heap_is_trimmed_after_every_repack(tied_on):
    # 2 layers x (qkv, o, gate_up, down) packed, plus the two tables handed to vLLM's dispatch
    assert tied_on["linear_packed"] == 8
    assert tied_on["counts"]["repack_trims"] == 8 + 2


def test_plain_vllm_in_an_edge_cpu_venv_is_left_as_vllm_made_it(tied_plain):
    # No engine mark: no plugin of edge-cpu's wrapped anything, so vLLM packs both modules its own way (the head's
    # product is vLLM's oneDNN closure), marks nothing, trims nothing, though every lever's switch is on.
    assert tied_plain["edge_engine"] is False and not any(tied_plain["levers"].values())
    assert not any(tied_plain["patched"].values()), tied_plain["patched"]
    tables = by_class(tied_plain)
    assert tables["VocabParallelEmbedding"]["packed"] and tables["ParallelLMHead"]["packed"]
    assert not tables["ParallelLMHead"]["shared_packed"]
    assert tables["VocabParallelEmbedding"]["role"] is None and tables["ParallelLMHead"]["role"] is None
    assert not any(tied_plain["counts"].values())


def test_an_engine_edge_starts_has_every_plugin_in_place(tied_on):
    assert tied_on["edge_engine"] is True and all(tied_on["levers"].values())
    assert tied_on["patched"] == {"dispatch": True, "loader": True, "worker_load_model": True,
                                  "runner_load_model": True}


def test_the_levers_do_not_change_the_tokens(tied_on, tied_plain):
    assert len(tied_on["token_ids"]) == 8 and tied_on["token_ids"] == tied_plain["token_ids"]


def test_levers_on_an_untied_head_keeps_only_its_packed_copy(untied_on):
    tables = by_class(untied_on)
    embed, head = tables["VocabParallelEmbedding"], tables["ParallelLMHead"]
    assert head["role"] == "untied_head" and head["packed"] and head["weight_elements"] == 0
    assert embed["role"] == "gather" and not embed["packed"] and embed["weight_elements"] == 8192 * 256
    assert len(untied_on["token_ids"]) == 8
