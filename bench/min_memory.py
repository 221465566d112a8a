"""The least memory a session runs under: edge's session and plain vLLM CPU at the same engine arguments (issue 36).

The figure: the smallest cgroup memory limit under which a session starts and
decodes *at its normal speed* -- within ``SLOW_RATIO`` (0.8) of its own decode
speed without a limit. Below that the kernel is evicting file-backed pages
(the checkpoint, the libraries' text) and faulting them back: the session
"runs" while thrashing, which is not running. Bisected to ``RESOLUTION``
(128 MiB) for two subjects at the same engine arguments:

* ``edge``: ``edge run --model DIR --max-model-len N --prompt ... --max-tokens M
  --ignore-eos --json``, edge's own engine with edge-cpu's levers, as edge
  launches it. The limit is applied once edge's plan has admitted (its
  "starting" line; ``--edge-limit-at start`` applies it from exec instead, and a
  plan that reads the limit then refuses: outcome ``refused``), so what is
  measured is the session's need, not the plan's verdict;
* ``plain``: vLLM CPU alone in a child of this script (``LLM(**engine_kwargs)``,
  the kwargs from ``edge plan --json`` at the same flags) in vLLM's own process
  layout, with edge's runtime environment for plain vLLM
  (``apply_runtime_env(edge_engine=False)``: edge-cpu's AMX permission, which
  vLLM needs on an AMX host and which holds no memory; none of its levers).

Each probe is a fresh process tree in a fresh child memory cgroup of this
process's own (v1 ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``,
or v2 ``memory.max`` and ``memory.swap.max = 0``), under ``engine-lock
measure`` (one engine at a time), subjects alternating. Before each probe the
checkpoint's files and every file of the interpreters' site-packages are
dropped from the page cache (``POSIX_FADV_DONTNEED``), so the probe's cgroup is
charged for the pages it reads, as on a cold machine (a page already cached is
charged to whoever read it first, and a limit would not see it); what stays
resident (mapped by another process) is recorded. At each limit ``edge plan
--json`` also runs inside a cgroup with that limit and its verdict is recorded:
a probe the plan admits that then fails is what the issue forbids.

Outcomes: ``runs``, ``slow`` (decode < 0.8x the unlimited run; retried once,
the better counts), ``oom_killed`` (the cgroup's ``oom_kill`` rose),
``failed`` (exit != 0 otherwise), ``timeout``, ``refused``. Only ``runs`` runs.

Checkpoints have real bytes on disk (random bf16 of magnitude 2^-9..2^-5,
norms 1.0; a sparse header-only file reads its holes as zeros from no page
cache): bench/budget_by_size.py's Qwen3 geometries, ``0.6b-tied``,
``llama-1b-tied`` / ``llama-1b-untied`` (Llama-3.2-1B), written under ``--out``
on first use; ``smollm2`` is the real SmolLM2-135M-Instruct (``--smollm2``).

    python bench/min_memory.py --out /work/models/minmem --geometries smollm2@4096,llama-1b-tied
    python bench/min_memory.py --report /work/models/minmem/results/min_memory.jsonl

One JSON line per probe (and one ``plan`` line per geometry) is appended to
``--results``; ``--report`` prints the table (docs/benchmarks.md, "The least
memory a session runs under").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: The bisection's grid: limits are whole multiples of this.
RESOLUTION = 128 * MIB
#: Decode below this fraction of the unlimited run's speed does not count as running.
SLOW_RATIO = 0.8
#: Where edge's admission figure is in ``edge plan --json``: the first of these keys found in ``plan["peak"]``,
#: then in the plan itself. Issue 36's pool branch may name the held (admitted) figure differently: put it first.
ADMISSION_FIELDS = ("admission_bytes",)
#: The plan terms the report lays beside the least limit (``reservations[].purpose``), in this order.
TERMS = ("runtime_baseline", "weights", "kv_cache", "activations", "weights_file_mapping", "embedding_packed_copy",
         "linear_repack_transient")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
#: edge's line on stderr once its plan has admitted and before the engine starts (edge_core/cli/run.py).
EDGE_STARTING = re.compile(r"^edge: starting \S+ on ")
#: ... and once the engine is ready, before the prompt is sent.
EDGE_READY = re.compile(r"^edge: starting \S+ on .* done in ")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: Seconds a session may take to end by itself after the cgroup's OOM killer took one of its processes (plain
#: vLLM's front end waits on a dead engine for minutes: docs/vllm-cpu-facts.md); then it is killed.
OOM_GRACE_S = 30.0
#: cgroup v1 reports "no limit" as a huge page-aligned number.
UNLIMITED = 1 << 62


# ---------------------------------------------------------------- checkpoints with real bytes


def _geometries() -> dict[str, tuple[dict, dict[str, list[int]]]]:
    """name -> (config.json, tensor shapes), from the two benches that define them."""
    sys.path.insert(0, str(HERE))
    import budget_by_size as sizes  # noqa: PLC0415 - bench modules, not a package
    import memory_vs_vllm as mvv  # noqa: PLC0415

    out: dict[str, tuple[dict, dict[str, list[int]]]] = {}
    for name, (hidden, inter, vocab, tie, _shards) in mvv.SIZES.items():
        if "shards" in name:
            continue
        cfg = sizes.qwen3_config(hidden, inter, vocab, tie)
        out[name] = (cfg, sizes.qwen3_tensors(cfg))
    for tie in (True, False):
        cfg = dict(mvv.LLAMA_1B, tie_word_embeddings=tie)
        out["llama-1b-tied" if tie else "llama-1b-untied"] = (cfg, mvv.llama_tensors(cfg))
    return out


def write_random_bf16(path: Path, tensors: dict[str, list[int]], seed: int = 0, chunk: int = 1 << 24) -> int:
    """A BF16 safetensors file with every byte written: random weights of magnitude 2^-9..2^-5, norms 1.0.

    Random sign and mantissa, exponent 118..121 (so no NaN, no inf, activations bounded); 1-D tensors (the
    RMSNorm weights) are 1.0 so the residual stream is not scaled away. Returns the data section's bytes.
    """
    import numpy as np  # noqa: PLC0415 - only the writer needs it

    sys.path.insert(0, str(HERE))
    from budget_by_size import bf16_header  # noqa: PLC0415 - bench modules, not a package

    raw, off = bf16_header(tensors)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for shape in tensors.values():
            n = math.prod(shape)
            if len(shape) == 1:
                f.write(np.full(n, 0x3F80, dtype="<u2").tobytes())
                continue
            for start in range(0, n, chunk):
                bits = rng.integers(0, 1 << 16, size=min(chunk, n - start), dtype=np.uint16)
                bits = (bits & 0x807F) | ((118 + ((bits >> 7) & 3)) << 7).astype(np.uint16)
                f.write(bits.astype("<u2").tobytes())
    tmp.rename(path)
    return off


def checkpoint(out: Path, name: str, smollm2: Path) -> Path:
    """The directory for geometry ``name``: SmolLM2, an existing directory, or written under ``out`` once."""
    if name == "smollm2":
        return smollm2
    if "/" in name:
        return Path(name)
    geoms = _geometries()
    if name not in geoms:
        raise SystemExit(f"unknown geometry {name!r}: one of smollm2, {', '.join(geoms)}, or a checkpoint directory")
    cfg, tensors = geoms[name]
    d = out / name
    stamp = {"geometry": name, "config": cfg, "writer": "random bf16 2^-9..2^-5, norms 1.0, seed 0"}
    done = d / "minmem.json"
    if done.exists() and json.loads(done.read_text()) == stamp:
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    demo = REPO / "edge_core" / "demo" / "tiny-llama"
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(demo / f, d / f)
    t0 = time.monotonic()
    n = write_random_bf16(d / "model.safetensors", tensors)
    done.write_text(json.dumps(stamp))
    print(f"wrote {d} ({n / MIB:,.0f} MiB of weights) in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return d


# ---------------------------------------------------------------- the memory cgroup


class CgroupError(RuntimeError):
    """No memory cgroup this process can make a child of, or a write the controller refused."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def own_memory_cgroup(root: Path = Path("/")) -> tuple[int, Path]:
    """(version, directory) of the memory cgroup this process is in; v1's memory line, else v2 with memory."""
    text = _read(root / "proc/self/cgroup") or ""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, rel = parts
        if "memory" in controllers.split(","):
            v1 = rel.strip().lstrip("/")
        elif hid == "0" and controllers == "":
            v2 = rel.strip().lstrip("/")
    if v1 is not None:
        d = root / "sys/fs/cgroup/memory" / v1
        if (d / "memory.limit_in_bytes").exists():
            return 1, d
    seen = []
    if v2 is not None:
        for base in (root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"):
            controllers = (_read(base / "cgroup.controllers") or "").split()
            if (base / "cgroup.controllers").exists():
                seen.append(f"{base} ({' '.join(controllers) or 'no controllers'})")
            if "memory" in controllers:
                return 2, base / v2
    raise CgroupError("no memory cgroup to nest under: /proc/self/cgroup has "
                      + (f"a v1 memory line ({v1}) without memory.limit_in_bytes" if v1 is not None else "no v1 memory line")
                      + (f"; cgroup v2 is mounted at {', '.join(seen)} without the memory controller" if seen else ""))


@dataclass
class MemoryCgroup:
    """A child memory cgroup this bench made, runs one probe in, and removes."""

    version: int
    path: Path

    @classmethod
    def create(cls, parent: tuple[int, Path], name: str) -> MemoryCgroup:
        version, base = parent
        path = base / name
        path.mkdir()
        if version == 2 and not (path / "memory.max").exists():
            try:  # v2 gives a child the controller only where the parent delegates it
                (base / "cgroup.subtree_control").write_text("+memory")
            except OSError as exc:
                path.rmdir()
                raise CgroupError(
                    f"{base} does not delegate the memory controller to its children and enabling it failed ({exc}): "
                    "cgroup v2 refuses while that cgroup holds processes; run this bench from a leaf cgroup that "
                    "delegates memory (e.g. systemd-run --scope -p Delegate=yes ...)") from exc
        return cls(version, path)

    def set_limit(self, limit: int) -> None:
        """Hard limit, swap included (no swap can hide a need: there is none here, and a host with swap gets 0)."""
        try:
            if self.version == 1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                if (self.path / "memory.memsw.limit_in_bytes").exists():  # memsw >= limit: written after it
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (self.path / "memory.max").write_text(str(limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
        except OSError as exc:
            raise CgroupError(f"cannot set {limit / MIB:,.0f} MiB on {self.path}: {exc}") from exc

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        return [int(p) for p in (_read(self.procs_file) or "").split() if p.isdigit()]

    def stats(self) -> dict[str, Any]:
        """What the controller counted: peak usage, OOM kills, limit hits, major faults."""
        def num(name: str) -> int | None:
            raw = (_read(self.path / name) or "").strip()
            return int(raw) if raw.isdigit() else None

        def keyed(name: str) -> dict[str, int]:
            out = {}
            for line in (_read(self.path / name) or "").splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
            return out

        stat = keyed("memory.stat")
        if self.version == 1:
            return {"max_usage_bytes": num("memory.max_usage_in_bytes"), "failcnt": num("memory.failcnt"),
                    "oom_kill": keyed("memory.oom_control").get("oom_kill"), "pgmajfault": stat.get("pgmajfault"),
                    "limit_bytes": num("memory.limit_in_bytes")}
        events = keyed("memory.events")
        limit = (_read(self.path / "memory.max") or "").strip()
        return {"max_usage_bytes": num("memory.peak"), "failcnt": events.get("max"), "oom_kill": events.get("oom_kill"),
                "pgmajfault": stat.get("pgmajfault"), "limit_bytes": int(limit) if limit.isdigit() else None}

    def kill_all(self, wait_s: float = 15.0) -> list[int]:
        """SIGKILL what is left in the cgroup (this probe's processes only: nothing else is put there)."""
        killed = []
        deadline = time.monotonic() + wait_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        return sorted(set(killed))

    def remove(self) -> None:
        self.kill_all()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        raise CgroupError(f"cannot remove {self.path}: {self.pids()} still in it")


def in_cgroup(cg: MemoryCgroup, cmd: list[str]) -> list[str]:
    """``cmd`` behind a shell that first moves itself into ``cg`` (its children inherit the cgroup)."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs_file), *cmd]


# ---------------------------------------------------------------- the page cache


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (mincore over a mapping that faults nothing in)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return 0
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        try:
            _libc.mincore(addr, size, vec)
        finally:
            _libc.munmap(addr, size)
        return sum(b & 1 for b in bytes(vec)) * PAGE
    finally:
        os.close(fd)


def files_under(dirs: Iterable[Path]) -> list[Path]:
    out = []
    for d in dirs:
        for top, _, names in os.walk(d):
            out.extend(Path(top) / n for n in names)
    return out


def evict(paths: Iterable[Path]) -> dict[str, int]:
    """Drop ``paths`` from the page cache; what stays is mapped (or being read) by another process."""
    files = total = resident = 0
    for p in paths:
        try:
            if not p.is_file() or p.is_symlink():
                continue
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        files += 1
        size = p.stat().st_size
        total += size
        if size >= 1 << 20:  # small files are text read once; the large ones (libraries, shards) are the cost
            resident += resident_bytes(p)
    return {"files": files, "bytes": total, "resident_after_bytes": resident}


def site_packages(python: Path) -> list[Path]:
    """The site-packages directories of the venv that ``python`` (or an entry point beside it) belongs to."""
    return sorted(python.absolute().parent.parent.glob("lib/python3*/site-packages"))


# ---------------------------------------------------------------- the bisection


@dataclass
class Bisection:
    """The least limit on a ``resolution`` grid that runs, assuming more memory never hurts.

    Starts at ``start``; from there steps down (or up) by ``step``, doubling, until a failing limit lies
    below a running one, then halves that interval until it is one grid step wide. A start near the answer
    (the unlimited run's steady state) brackets it in two or three probes.
    """

    start: int
    resolution: int = RESOLUTION
    step: int = 2 * RESOLUTION
    ceiling: int | None = None
    results: dict[int, bool] = field(default_factory=dict)
    _down: int = 0
    _up: int = 0

    def grid(self, n: int) -> int:
        return max(self.resolution, -(-n // self.resolution) * self.resolution)

    @property
    def hi(self) -> int | None:
        """The least limit that ran."""
        return min((lim for lim, ok in self.results.items() if ok), default=None)

    @property
    def lo(self) -> int | None:
        """The largest limit that failed below ``hi`` (any, while nothing ran)."""
        hi = self.hi
        return max((lim for lim, ok in self.results.items() if not ok and (hi is None or lim < hi)), default=None)

    @property
    def non_monotone(self) -> list[int]:
        """Limits that failed at or above one that ran: noise, or a need that is not monotone."""
        hi = self.hi
        return sorted(lim for lim, ok in self.results.items() if not ok and hi is not None and lim > hi)

    def next(self) -> int | None:
        """The next limit to try, or None when done (bracketed to the resolution, or nothing left to try)."""
        hi, lo = self.hi, self.lo
        start = self.grid(self.start)
        if start not in self.results and (hi is None or start < hi) and (lo is None or start > lo):
            return start  # first, or after probes an earlier run made (--resume)
        if hi is not None and lo is not None:
            if hi - lo <= self.resolution:
                return None
            mid = lo + (hi - lo) // 2 // self.resolution * self.resolution
            return mid if lo < mid < hi else None
        if hi is not None:  # only runs so far: step down
            if hi <= self.resolution:
                return None
            target = max(self.resolution, hi - (self.step << self._down))
            self._down += 1
            return target
        assert lo is not None  # only failures so far: step up
        target = lo + (self.step << self._up)
        self._up += 1
        if self.ceiling is not None:
            target = min(target, self.grid(self.ceiling))
        return None if target <= lo or target in self.results else target

    def record(self, limit: int, runs: bool) -> None:
        self.results[limit] = runs

    @property
    def done(self) -> bool:
        return self.next_peek() is None

    def next_peek(self) -> int | None:
        down, up = self._down, self._up
        try:
            return self.next()
        finally:
            self._down, self._up = down, up


def classify(rc: int | None, timed_out: bool, refused: bool, oom_kills: int, decode: float | None,
             baseline_decode: float | None, slow_ratio: float = SLOW_RATIO) -> str:
    """A probe's outcome; only ``runs`` counts as running."""
    if refused:
        return "refused"
    if timed_out or rc != 0 or decode is None:  # an OOM kill is the cause even where the session then hung
        return "oom_killed" if oom_kills else "timeout" if timed_out else "failed"
    if baseline_decode and decode < slow_ratio * baseline_decode:
        return "slow"
    return "runs"


def least_limits(starts: dict[str, int], run: Callable[[str, int], dict[str, Any]], *, order: list[str],
                 slow_retries: int = 1, ceiling: int | None = None,
                 write: Callable[[dict[str, Any]], None] = lambda rec: None,
                 seed: dict[str, list[tuple[int, bool]]] | None = None) -> dict[str, Bisection]:
    """Bisect every subject's least limit, one probe each in turn (``order``), from ``starts`` (bytes).

    ``run(subject, limit)`` is one probe's record (its ``outcome``); a ``slow`` probe is rerun up to
    ``slow_retries`` times and the better run counts (a busy machine slows a run that is not thrashing).
    Every record goes to ``write``, the superseded ones marked so. ``seed``: probes an earlier run made.
    """
    bis = {s: Bisection(start=max(starts[s], RESOLUTION), ceiling=ceiling) for s in order}
    for s, done in (seed or {}).items():
        for limit, runs in done:
            if s in bis:
                bis[s].record(limit, runs)
    while any(not b.done for b in bis.values()):
        for s in order:
            if (limit := bis[s].next()) is None:
                continue
            rec = run(s, limit)
            for _ in range(slow_retries if rec["outcome"] == "slow" else 0):
                write(dict(rec, kind="probe", superseded=True))
                again = run(s, limit)
                if again["outcome"] == "runs" or (again.get("decode_tok_s") or 0) > (rec.get("decode_tok_s") or 0):
                    rec = again
                if rec["outcome"] != "slow":
                    break
            rec["kind"] = "probe"
            bis[s].record(limit, rec["outcome"] == "runs")
            write(rec)
    return bis


# ---------------------------------------------------------------- the plain subject (a child of this script)


def plain_child(kwargs: dict, prompt: str, max_tokens: int) -> None:
    """vLLM CPU alone at ``kwargs``: start, one greedy request, decode speed as edge measures it."""
    t0 = time.monotonic()
    from edge_core.runtime.env import apply_runtime_env  # noqa: PLC0415

    apply_runtime_env(edge_engine=False)  # no EDGE_ENGINE mark: edge-cpu's levers stay off, its AMX permission on
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    imported = time.monotonic()
    llm = LLM(**kwargs)
    started = time.monotonic()
    print("PHASE loaded", flush=True)
    engine = llm.llm_engine
    engine.add_request("minmem-0", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    submitted = time.perf_counter()
    first = last = None
    n_first = n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            k = len(out.outputs[0].token_ids)
            if k > n:
                now = time.perf_counter()
                if first is None:
                    first, n_first = now, k
                last, n = now, k
    rate = (n - n_first) / (last - first) if first is not None and last is not None and last > first else None
    print("RESULT " + json.dumps({"tokens": n, "decode_tok_s": rate, "engine_start_s": started - imported,
                                  "vllm_import_s": imported - t0,
                                  "ttft_s": None if first is None else first - submitted}), flush=True)
    engine.engine_core.shutdown()


# ---------------------------------------------------------------- one probe (runs under engine-lock)


def _tree_pss(pids: list[int]) -> tuple[int, int, int]:
    tot = [0, 0, 0]
    for pid in pids:
        for line in (_read(Path(f"/proc/{pid}/smaps_rollup")) or "").splitlines():
            key, _, rest = line.partition(":")
            idx = {"Pss": 0, "Pss_Anon": 1, "Pss_File": 2}.get(key)
            if idx is not None:
                tot[idx] += int(rest.split()[0]) * 1024
    return tot[0], tot[1], tot[2]


class Sampler(threading.Thread):
    """The cgroup's processes' PSS (anon, file) every ``period`` s, and the cgroup's own usage."""

    def __init__(self, cg: MemoryCgroup, period: float = 0.5):
        super().__init__(daemon=True)
        self.cg, self.period = cg, period
        self.stop = threading.Event()
        self.peak = (0, 0, 0)
        self.procs_max = 0
        self.ready = threading.Event()  # set once the engine is ready: what follows is the steady state
        self.ready_peak = 0

    def run(self) -> None:
        while not self.stop.wait(self.period):
            pids = self.cg.pids()
            self.procs_max = max(self.procs_max, len(pids))
            sample = _tree_pss(pids)
            if sample[0] > self.peak[0]:
                self.peak = sample
            if self.ready.is_set():
                self.ready_peak = max(self.ready_peak, sample[0])


def plan_at(edge: str, model: Path, max_model_len: int, edge_args: list[str], parent: tuple[int, Path],
            name: str, limit: int | None) -> dict[str, Any]:
    """``edge plan --json`` inside a cgroup with ``limit``: what edge would decide under it."""
    cg = MemoryCgroup.create(parent, name)
    try:
        if limit is not None:
            cg.set_limit(limit)
        out = subprocess.run(in_cgroup(cg, [edge, "plan", "--model", str(model), "--max-model-len",
                                            str(max_model_len), *edge_args, "--json"]),
                             capture_output=True, text=True, timeout=300, check=False)
    finally:
        cg.remove()
    try:
        plan = json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"rc": out.returncode, "error": out.stderr.strip()[-500:]}
    # A refused plan states no peak; its capacity refusal says what it needed (the same admission figure).
    needed = next((r.get("details", {}).get("needed_bytes") for r in plan.get("refusals") or []
                   if isinstance(r.get("details", {}).get("needed_bytes"), int)), None)
    return {"rc": out.returncode, "admitted": plan.get("admitted"), "capacity_bytes": plan.get("capacity_bytes"),
            "admission_bytes": admission_of(plan) or needed,
            "refusals": [r.get("code") or r.get("reason") for r in plan.get("refusals") or []]}


def admission_of(plan: dict) -> int | None:
    for key in ADMISSION_FIELDS:
        for where in (plan.get("peak") or {}, plan):
            if isinstance(where.get(key), int):
                return where[key]
    return None


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one subject once under one limit (None: no limit) in a fresh cgroup; the record of what happened."""
    parent = own_memory_cgroup()
    model, limit, subject = Path(spec["model"]), spec["limit_bytes"], spec["subject"]
    tag = f"minmem-{os.getpid()}"
    rec: dict[str, Any] = {k: spec[k] for k in ("geometry", "max_model_len", "subject", "limit_bytes", "run_id")}
    rec["cgroup_version"] = parent[0]
    rec["evicted"] = evict([*model.iterdir(), *files_under(Path(p) for p in spec["evict_dirs"])])
    if spec["plan_at_limit"]:
        rec["plan_at_limit"] = plan_at(spec["edge"], model, spec["max_model_len"], spec["edge_args"], parent,
                                       tag + "-plan", limit)
    logs = Path(spec["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{spec['geometry'].replace('/', '_')}-{spec['max_model_len']}-{subject}-{limit or 0}-{tag}.log"
    if subject == "edge":
        cmd = [spec["edge"], "run", "--model", str(model), "--max-model-len", str(spec["max_model_len"]),
               *spec["edge_args"], "--prompt", spec["prompt"], "--max-tokens", str(spec["max_tokens"]),
               "--ignore-eos", "--json", "--engine-log", str(log)]
        deferred = limit is not None and spec["edge_limit_at"] == "engine"
    else:
        cmd = [sys.executable, __file__, "--plain-child", json.dumps(spec["engine_kwargs"]),
               "--prompt", spec["prompt"], "--max-tokens", str(spec["max_tokens"])]
        deferred = False
    cg = MemoryCgroup.create(parent, tag)
    stdout_lines: list[str] = []
    stderr_lines: list[str] = []
    applied: list[float] = []
    errors: list[str] = []
    ready_faults: list[int] = []
    t0 = time.monotonic()
    timed_out = False
    try:
        if limit is not None and not deferred:
            cg.set_limit(limit)
            applied.append(0.0)
        sampler = Sampler(cg)
        err_sink = None if subject == "edge" else open(log, "w")  # noqa: SIM115 - closed below
        with subprocess.Popen(in_cgroup(cg, cmd), stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE if subject == "edge" else err_sink) as proc:
            sampler.start()

            def pump(stream: Any, sink: list[str], on_line: Callable[[str], None] | None = None) -> None:
                for line in stream:
                    sink.append(line)
                    if on_line:
                        on_line(line)

            def ready() -> None:  # major faults from here on are the decode's (and the stop's)
                ready_faults.append(cg.stats().get("pgmajfault") or 0)
                sampler.ready.set()

            def on_out(line: str) -> None:
                if line.startswith("PHASE loaded"):
                    ready()

            def on_err(line: str) -> None:
                if EDGE_READY.match(line):
                    ready()
                if deferred and not applied and not errors and EDGE_STARTING.match(line):
                    try:
                        cg.set_limit(limit)
                        applied.append(time.monotonic() - t0)
                    except CgroupError as exc:  # the limit is below what the plan already holds: kill, say so
                        errors.append(str(exc))
                        cg.kill_all(wait_s=1)

            readers = [threading.Thread(target=pump, args=(proc.stdout, stdout_lines, on_out), daemon=True)]
            if proc.stderr is not None:
                readers.append(threading.Thread(target=pump, args=(proc.stderr, stderr_lines, on_err), daemon=True))
            for r in readers:
                r.start()
            oom_at = None
            while proc.poll() is None:  # a session that lost a process to the OOM killer is over: say how fast
                now = time.monotonic() - t0
                if now > spec["timeout_s"]:
                    timed_out = True
                    cg.kill_all()
                    break
                if oom_at is None and (cg.stats().get("oom_kill") or 0) > 0:
                    oom_at = now
                if oom_at is not None and now - oom_at > OOM_GRACE_S:
                    rec["killed_after_oom_s"] = round(now - oom_at, 1)  # it had not ended by itself
                    cg.kill_all()
                    break
                time.sleep(0.5)
            proc.wait()
            for r in readers:
                r.join(timeout=10)
        if err_sink:
            err_sink.close()
        sampler.stop.set()
        sampler.join()
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        rec["leftover_killed"] = cg.kill_all()
        rec["cgroup"] = cg.stats()
    finally:
        cg.remove()
    rec["rc"] = proc.returncode
    rec["limit_applied_at_s"] = round(applied[0], 1) if applied else None
    if ready_faults and rec["cgroup"].get("pgmajfault") is not None:  # thrashing faults here; a busy machine does not
        rec["majfault_after_ready"] = rec["cgroup"]["pgmajfault"] - ready_faults[0]
    rec["tree_pss_peak"] = {"pss": sampler.peak[0], "anon": sampler.peak[1], "file": sampler.peak[2],
                            "after_ready": sampler.ready_peak or None,
                            "processes_max": sampler.procs_max}
    decode = start_s = None
    refused = False
    if subject == "edge":
        try:
            doc = json.loads("".join(stdout_lines))
        except json.JSONDecodeError:
            doc = {}
        if doc.get("schema") == "edge.run":
            timings = doc.get("timings") or {}
            decode, start_s = timings.get("decode_tokens_per_s"), timings.get("engine_start_s")
            rec["tokens"] = doc.get("tokens")
            mem = doc.get("memory") or {}
            rec["edge_measured_bytes"] = mem.get("measured_attributable_bytes")
        refused = proc.returncode == 2 and doc.get("schema") == "edge.plan" and doc.get("admitted") is False
        tail = [ln.rstrip() for ln in stderr_lines if ln.startswith("edge:")][-6:]
    else:
        result = next((json.loads(ln[7:]) for ln in stdout_lines if ln.startswith("RESULT ")), None)
        if result:
            decode, start_s, rec["tokens"] = result["decode_tok_s"], result["engine_start_s"], result["tokens"]
        rec["loaded"] = any(ln.startswith("PHASE loaded") for ln in stdout_lines)
        tail = (_read(log) or "").splitlines()[-6:]
    rec["decode_tok_s"] = None if decode is None else round(decode, 3)
    rec["engine_start_s"] = None if start_s is None else round(start_s, 1)
    rec["outcome"] = classify(proc.returncode, timed_out, refused, (rec["cgroup"].get("oom_kill") or 0),
                              decode, spec.get("baseline_decode"), spec["slow_ratio"])
    if deferred and not applied and not refused:  # it ran without the limit: not a measurement at it
        errors.append("the limit was never applied: edge printed no 'starting' line")
    if errors:
        rec["outcome"], rec["error"] = "error", "; ".join(errors)
    if spec.get("baseline_decode") and decode:
        rec["decode_ratio"] = round(decode / spec["baseline_decode"], 3)
    if rec["outcome"] != "runs" or limit is None:
        rec["tail"] = tail
        rec["log"] = str(log) if log.exists() else None
    elif log.exists():
        log.unlink()
    return rec


# ---------------------------------------------------------------- the driver


def host_facts() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in (_read(Path("/proc/cpuinfo")) or "").splitlines()
                if ln.startswith("model name")), platform.processor())
    total = next((int(ln.split()[1]) * 1024 for ln in (_read(Path("/proc/meminfo")) or "").splitlines()
                  if ln.startswith("MemTotal:")), None)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    tree_dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                 *CODE_UNDER_TEST], capture_output=True, text=True, check=False).stdout.strip()
    try:
        cgroup = own_memory_cgroup()
        cg = {"version": cgroup[0], "path": str(cgroup[1])}
    except CgroupError as exc:
        cg = {"error": str(exc)}
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_total_bytes": total, "kernel": platform.release(),
            "commit": commit + ("+dirty" if dirty else ""),
            "edge_tree": (code_tree(commit) or "?") + ("+dirty" if tree_dirty else ""), "cgroup": cg}


#: What a figure depends on: edge's code (not this bench's).
CODE_UNDER_TEST = ("edge_core", "plugins")


def code_tree(commit: str) -> str | None:
    """A short name for the trees of ``CODE_UNDER_TEST`` at ``commit``: runs of the same edge share it."""
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", *(f"{commit}:{p}" for p in CODE_UNDER_TEST)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    import hashlib  # noqa: PLC0415

    return hashlib.sha1(out.stdout.encode()).hexdigest()[:10]


def tree_of(plan_row: dict) -> str:
    host = plan_row.get("host") or {}
    if host.get("edge_tree"):
        return host["edge_tree"]
    commit = host.get("commit", "?")  # a record from before the field: derive it from the commit
    dirty = commit.endswith("+dirty")
    tree = code_tree(commit.removesuffix("+dirty"))
    return (tree + ("+dirty?" if dirty else "")) if tree else commit


def edge_plan(edge: str, model: Path, max_model_len: int, edge_args: list[str]) -> dict:
    out = subprocess.run([edge, "plan", "--model", str(model), "--max-model-len", str(max_model_len), *edge_args,
                          "--json"], capture_output=True, text=True, check=False)
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"edge plan failed ({out.returncode}): {out.stderr.strip()[-1000:]}") from exc


def plan_summary(plan: dict) -> dict[str, Any]:
    terms: dict[str, int] = {}
    for r in plan.get("reservations") or []:
        if r.get("pool") == "host_ram" and not r.get("headroom"):
            terms[r["purpose"]] = terms.get(r["purpose"], 0) + r["bytes"]
    return {"admitted": plan.get("admitted"), "admission_bytes": admission_of(plan), "admission_field": ADMISSION_FIELDS,
            "peak": plan.get("peak"), "terms": terms, "capacity_bytes": plan.get("capacity_bytes"),
            "engine_kwargs": plan.get("engine_kwargs"), "schema_version": plan.get("schema_version")}


def run_probe(spec: dict, lock: str) -> dict:
    """One probe as a child of this script under ``lock measure`` (one engine on the machine at a time)."""
    cmd = [sys.executable, spec.get("script", __file__), "--probe", json.dumps(spec)]
    if lock:
        cmd = [lock, "measure", *cmd]
    t0 = time.monotonic()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("PROBE ")), None)
    if line is None:
        return dict({k: spec[k] for k in ("geometry", "max_model_len", "subject", "limit_bytes", "run_id")},
                    outcome="error", rc=out.returncode, tail=out.stdout.splitlines()[-6:])
    rec = json.loads(line[6:])
    rec["locked_wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def measure(args: argparse.Namespace) -> int:
    args.results.parent.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    host = host_facts()
    edge_sp = site_packages(Path(args.edge))
    evict_dirs = [str(p) for p in dict.fromkeys([*site_packages(Path(sys.executable)), *edge_sp])]
    # Probes run a copy of this file as it was at the start: editing the tree during a run changes nothing.
    script = args.results.parent / f"min_memory-{run_id}.py"
    shutil.copy(__file__, script)

    def write(rec: dict) -> None:
        rec.setdefault("run_id", run_id)
        rec["t"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        with args.results.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def show(rec: dict) -> None:
        lim = "unlimited" if rec.get("limit_bytes") is None else f"{rec['limit_bytes'] / MIB:,.0f} MiB"
        cgs = rec.get("cgroup") or {}
        print(f"  {rec['subject']:>5} @ {lim:>10}: {rec['outcome']:<10} decode {rec.get('decode_tok_s')} tok/s "
              f"({rec.get('decode_ratio', '-')}), start {rec.get('engine_start_s')} s, major faults "
              f"{(rec.get('cgroup') or {}).get('pgmajfault')} ({rec.get('majfault_after_ready')} after ready), cgroup peak "
              f"{(cgs.get('max_usage_bytes') or 0) / MIB:,.0f} MiB, tree PSS peak "
              f"{(rec.get('tree_pss_peak') or {}).get('pss', 0) / MIB:,.0f} MiB, oom {cgs.get('oom_kill')}, plan "
              f"{(rec.get('plan_at_limit') or {}).get('admitted', '-')}", flush=True)

    subjects = args.subjects.split(",")
    for gi, geom in enumerate(args.geometries.split(",")):
        name, _, mml = geom.partition("@")
        max_model_len = int(mml) if mml else args.max_model_len
        model = checkpoint(args.out, name, args.smollm2).absolute()
        plan = edge_plan(args.edge, model, max_model_len, args.edge_arg)
        summary = plan_summary(plan)
        write({"kind": "plan", "geometry": name, "max_model_len": max_model_len, "model": str(model),
               "host": host, **summary})
        adm = summary["admission_bytes"] or 0
        print(f"{name} @ {max_model_len}: edge admits {adm / MIB:,.0f} MiB ({model})", flush=True)
        if not plan.get("admitted"):
            print(f"  edge plan refuses without a limit: {plan.get('refusals')}", flush=True)
        base: dict[str, Any] = {"geometry": name, "max_model_len": max_model_len, "model": str(model),
                                "run_id": run_id, "edge": args.edge, "edge_args": args.edge_arg,
                                "engine_kwargs": plan.get("engine_kwargs"), "prompt": args.prompt,
                                "max_tokens": args.max_tokens, "evict_dirs": evict_dirs,
                                "logs": str(args.results.parent / "logs"), "edge_limit_at": args.edge_limit_at,
                                "slow_ratio": args.slow_ratio, "plan_at_limit": not args.no_plan_at_limit,
                                "script": str(script)}
        order = subjects if gi % 2 == 0 else subjects[::-1]
        baselines: dict[str, dict] = {}
        seed: dict[str, list[tuple[int, bool]]] = {}
        if args.resume:
            baselines, seed = earlier(args.results, name, max_model_len, host["edge_tree"])
            for s, b in baselines.items():
                print(f"  {s}: resuming from run {b['run_id']} ({len(seed.get(s, []))} probes)", flush=True)
        for s in order:
            if s in baselines:
                continue
            rec = run_probe(dict(base, subject=s, limit_bytes=None, timeout_s=args.baseline_timeout), args.lock)
            rec["kind"] = "baseline"
            write(rec)
            show(rec)
            if rec["outcome"] == "runs":
                baselines[s] = rec

        def run(subject: str, limit: int, base: dict = base, baselines: dict[str, dict] = baselines) -> dict:
            b = baselines[subject]
            return run_probe(dict(base, subject=subject, limit_bytes=limit, baseline_decode=b["decode_tok_s"],
                                  timeout_s=args.timeout or max(300, 3 * b["wall_s"])), args.lock)

        def log(rec: dict) -> None:
            write(rec)
            show(rec)

        # The steady state (after the engine is ready) is near the least limit; the load's peak is mostly file
        # pages the kernel can take back.
        # (A resumed baseline from before that figure: the plan's steady state.)
        steady = (summary.get("peak") or {}).get("steady_state_bytes")
        starts = {s: b["tree_pss_peak"].get("after_ready") or steady or b["tree_pss_peak"]["pss"]
                  for s, b in baselines.items()}
        bis = least_limits(starts, run,
                           order=[s for s in order if s in baselines], slow_retries=args.slow_retries,
                           ceiling=host["mem_total_bytes"], write=log, seed=seed)
        for s, b in bis.items():
            print(f"  {s}: least limit {fmt_mib(b.hi)} (fails at {fmt_mib(b.lo)})"
                  + (f"; failed above it at {[fmt_mib(x) for x in b.non_monotone]}" if b.non_monotone else ""),
                  flush=True)
    print(f"results: {args.results}")
    return 0


def earlier(results: Path, geometry: str, max_model_len: int, edge_tree: str
            ) -> tuple[dict[str, dict], dict[str, list[tuple[int, bool]]]]:
    """Baselines and probes already in ``results`` for this geometry and context, at the same edge code."""
    if not results.exists() or edge_tree.endswith("dirty"):
        return {}, {}
    rows = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]
    runs = {r["run_id"] for r in rows if r.get("kind") == "plan" and r["geometry"] == geometry
            and r["max_model_len"] == max_model_len and tree_of(r) == edge_tree}
    mine = [r for r in rows if r.get("run_id") in runs and r.get("kind") in ("baseline", "probe")
            and r["geometry"] == geometry and r["max_model_len"] == max_model_len and not r.get("superseded")]
    baselines = {r["subject"]: r for r in mine if r["kind"] == "baseline" and r["outcome"] == "runs"}
    seed: dict[str, list[tuple[int, bool]]] = {}
    for r in mine:
        if r["kind"] == "probe" and r["subject"] in baselines and r["outcome"] != "error":
            seed.setdefault(r["subject"], []).append((r["limit_bytes"], r["outcome"] == "runs"))
    return baselines, seed


# ---------------------------------------------------------------- the report


def fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def summarize(rows: list[dict]) -> list[dict[str, Any]]:
    """Per (geometry, context, commit): each subject's least running limit, its bracket, and the plan beside them."""
    groups: dict[tuple, dict[str, Any]] = {}
    plans: dict[tuple, dict] = {}
    for r in rows:
        if r.get("kind") == "plan":
            key = (r["geometry"], r["max_model_len"], r["run_id"])
            plans[key] = r
    run_commit = {r["run_id"]: tree_of(r) for r in plans.values()}
    replans = [r for r in rows if r.get("kind") == "replan"]
    for r in rows:
        if r.get("kind") in ("plan", "replan"):
            continue
        key = (r["geometry"], r["max_model_len"], run_commit.get(r["run_id"], "?"))
        g = groups.setdefault(key, {"geometry": key[0], "max_model_len": key[1], "commit": key[2], "plan": None,
                                    "subjects": {}})
        g["plan"] = plans.get((r["geometry"], r["max_model_len"], r["run_id"])) or g["plan"]
        s = g["subjects"].setdefault(r["subject"], {"probes": [], "baselines": [], "retried": {}})
        if r.get("superseded"):  # a slow run, rerun: shown beside the run that counted
            s["retried"].setdefault(r["limit_bytes"], []).append(r.get("decode_ratio"))
            continue
        (s["baselines"] if r.get("limit_bytes") is None else s["probes"]).append(r)
    for g in groups.values():
        for s in g["subjects"].values():
            runs = [p["limit_bytes"] for p in s["probes"] if p["outcome"] == "runs"]
            s["least"] = min(runs, default=None)
            below = [p for p in s["probes"] if p["outcome"] != "runs" and (s["least"] is None or p["limit_bytes"] < s["least"])]
            top_fail = max(below, key=lambda p: p["limit_bytes"], default=None)
            s["fails_at"] = top_fail["limit_bytes"] if top_fail else None
            s["fails_how"] = top_fail["outcome"] if top_fail else None
            s["non_monotone"] = sorted({p["limit_bytes"] for p in s["probes"]
                                        if p["outcome"] != "runs" and s["least"] is not None
                                        and p["limit_bytes"] > s["least"]})
            ok = [b for b in s["baselines"] if b["outcome"] == "runs"]
            s["baseline_decode"] = statistics.median(b["decode_tok_s"] for b in ok) if ok else None
            s["tree_pss_peak"] = max((b["tree_pss_peak"]["pss"] for b in ok), default=None)
            s["cgroup_peak"] = max(((b.get("cgroup") or {}).get("max_usage_bytes") or 0 for b in ok), default=None)
        edge = g["subjects"].get("edge", {})
        g["admitted_but_failed"] = sorted({p["limit_bytes"] for p in edge.get("probes", [])
                                           if (p.get("plan_at_limit") or {}).get("admitted") and p["outcome"] != "runs"})
        g["refused_but_ran"] = sorted({p["limit_bytes"] for p in edge.get("probes", [])
                                       if (p.get("plan_at_limit") or {}).get("admitted") is False and p["outcome"] == "runs"})
        # What edge admits against under the least limit its session runs under (its plan inside that cgroup: no
        # external reserve where the host has room beyond it), else the unlimited plan's figure.
        # The newest --replan first (it may be of a re-fitted plan: its row names the code tree that planned), then
        # the plan each probe recorded.
        mine = [r for r in reversed(replans)
                if (r["geometry"], r["max_model_len"], r["tree"]) == (g["geometry"], g["max_model_len"], g["commit"])]
        at_least = [r["plan_at_limit"].get("admission_bytes") for r in mine if r["limit_bytes"] == edge.get("least")]
        at_least += [(p.get("plan_at_limit") or {}).get("admission_bytes") for p in edge.get("probes", [])
                     if p["limit_bytes"] == edge.get("least") and p["outcome"] == "runs"]
        g["replanned_by"] = mine[0].get("planned_by") if mine else None
        g["admission_at_least"] = next((a for a in at_least if isinstance(a, int)), None)
    return list(groups.values())


def replan(results: Path, edge: str) -> int:
    """For each (geometry, context, code tree) of ``results``: ``edge plan`` under edge's least limit, appended."""
    rows = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]
    plans = {(r["geometry"], r["max_model_len"], tree_of(r)): r for r in rows if r.get("kind") == "plan"}
    parent = own_memory_cgroup()
    planned_by = host_facts()["edge_tree"]  # this checkout's edge, which plans below (no other on PYTHONPATH)
    with results.open("a") as out:
        for g in summarize(rows):
            least = g["subjects"].get("edge", {}).get("least")
            plan = plans.get((g["geometry"], g["max_model_len"], g["commit"]))
            if least is None or plan is None:
                continue
            verdict = plan_at(edge, Path(plan["model"]), g["max_model_len"], [], parent, f"replan-{os.getpid()}",
                              least)
            row = {"kind": "replan", "geometry": g["geometry"], "max_model_len": g["max_model_len"],
                   "tree": g["commit"], "planned_by": planned_by, "limit_bytes": least,
                   "plan_at_limit": verdict}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


def report(paths: list[Path]) -> int:
    rows = [json.loads(ln) for p in paths for ln in p.read_text().splitlines() if ln.strip()]
    groups = summarize(rows)
    print("| geometry | context | edge tree | plain vLLM least limit (fails at) | edge least limit (fails at) "
          "| edge admission there (unlimited) | admission / edge least | admitted, then failed | refused, yet ran "
          "|\n|---|---|---|---|---|---|---|---|---|")
    for g in groups:
        plain, edge = g["subjects"].get("plain", {}), g["subjects"].get("edge", {})
        unlimited = (g["plan"] or {}).get("admission_bytes")
        adm = g.get("admission_at_least") or unlimited
        ratio = f"**{adm / edge['least']:.3f}**" if adm and edge.get("least") else "-"

        def cell(s: dict) -> str:
            if not s:
                return "-"
            return f"{fmt_mib(s.get('least'))} MiB ({fmt_mib(s.get('fails_at'))}: {s.get('fails_how') or '-'})"

        bad = ", ".join(fmt_mib(x) for x in g["admitted_but_failed"]) or "none"
        false_no = ", ".join(fmt_mib(x) for x in g["refused_but_ran"]) or "none"
        print(f"| {g['geometry']} | {g['max_model_len']} | {g['commit']} | {cell(plain)} | {cell(edge)} "
              f"| {fmt_mib(adm)} MiB ({fmt_mib(unlimited)}) | {ratio} | {bad} | {false_no} |")
    replanned = sorted({g["replanned_by"] for g in groups if g.get("replanned_by")})
    if replanned:
        print(f"\nThe admission column as planned (--replan) by edge's code tree {', '.join(replanned)}.")
    print("\nUnlimited runs and the plan's terms (MiB; decode tok/s):\n")
    print("| geometry | context | subject | decode | tree-PSS peak | cgroup peak | least limit | "
          + " | ".join(TERMS) + " | load path | steady | admission |\n|" + "---|" * (10 + len(TERMS)))
    for g in groups:
        plan = g["plan"] or {}
        terms = plan.get("terms") or {}
        peak = plan.get("peak") or {}
        for name, s in g["subjects"].items():
            print(f"| {g['geometry']} | {g['max_model_len']} | {name} | {s['baseline_decode'] or '-'} "
                  f"| {fmt_mib(s['tree_pss_peak'])} | {fmt_mib(s['cgroup_peak'])} | {fmt_mib(s['least'])} | "
                  + " | ".join(fmt_mib(terms.get(t)) for t in TERMS)
                  + f" | {fmt_mib(peak.get('load_path_bytes'))} | {fmt_mib(peak.get('steady_state_bytes'))} "
                  f"| {fmt_mib(plan.get('admission_bytes'))} |")
    print("\nEvery probe (limit MiB: outcome, decode ratio):\n")
    for g in groups:
        for name, s in g["subjects"].items():
            probes = sorted(s["probes"], key=lambda p: -p["limit_bytes"])
            line = ", ".join(f"{fmt_mib(p['limit_bytes'])}: {p['outcome']}"
                             + (f" {p['decode_ratio']}" if p.get("decode_ratio") is not None else "")
                             + (f" (after slow {', '.join(map(str, s['retried'][p['limit_bytes']]))})"
                                if p["limit_bytes"] in s["retried"] else "") for p in probes)
            warn = f" [failed above the least limit at {', '.join(map(fmt_mib, s['non_monotone']))}]" if s["non_monotone"] else ""
            print(f"- {g['geometry']} @ {g['max_model_len']}, {name}: {line}{warn}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/minmem"), help="where the written checkpoints go")
    ap.add_argument("--geometries", default="smollm2@4096,llama-1b-tied",
                    help="comma-separated NAME[@MAX_MODEL_LEN]: smollm2, 150m, 640m, 0.6b, 0.6b-tied, 1.7b, "
                    "llama-1b-tied, llama-1b-untied, or a checkpoint directory")
    ap.add_argument("--max-model-len", type=int, default=4096, help="context where a geometry names none")
    ap.add_argument("--smollm2", type=Path, default=Path("/work/models/smollm2-135m-instruct"))
    ap.add_argument("--subjects", default="edge,plain", help="edge, plain or both (alternated)")
    ap.add_argument("--results", type=Path, help="JSONL to append to (default OUT/results/min_memory.jsonl)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slow-ratio", type=float, default=SLOW_RATIO)
    ap.add_argument("--slow-retries", type=int, default=1, help="reruns of a probe that ran slow (the best counts)")
    ap.add_argument("--timeout", type=float, help="seconds per limited probe (default: 3x the unlimited run, >= 300)")
    ap.add_argument("--baseline-timeout", type=float, default=900)
    ap.add_argument("--edge-limit-at", choices=("engine", "start"), default="engine",
                    help="apply the limit once edge's plan admitted (engine), or from exec (start)")
    ap.add_argument("--no-plan-at-limit", action="store_true", help="skip `edge plan` under each limit")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the unlimited runs and probes --results already has for a geometry at this edge code")
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    ap.add_argument("--edge-arg", action="append", default=[], help="a planning flag for edge plan and edge run")
    ap.add_argument("--lock", default="/work/bin/engine-lock" if Path("/work/bin/engine-lock").exists() else "",
                    help="the engine lock each probe runs under ('' for none)")
    ap.add_argument("--report", type=Path, nargs="+", help="print the table of these JSONL files and exit")
    ap.add_argument("--replan", type=Path, metavar="RESULTS",
                    help="plan each geometry of RESULTS inside a cgroup at edge's least limit there (with this "
                    "edge), append the verdicts, and exit: the admission the table divides, where no probe's plan "
                    "recorded it")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--plain-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plain_child:
        plain_child(json.loads(args.plain_child), args.prompt, args.max_tokens)
        return 0
    if args.probe:
        print("PROBE " + json.dumps(probe(json.loads(args.probe))), flush=True)
        return 0
    if args.report:
        return report(args.report)
    if args.replan:
        return replan(args.replan, args.edge)
    args.edge_arg = [a for arg in args.edge_arg for a in arg.split()]
    args.results = args.results or args.out / "results" / "min_memory.jsonl"
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
