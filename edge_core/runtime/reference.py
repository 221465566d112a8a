"""How does plain vLLM run a plan's engine arguments, untouched by edge, for ``edge parity`` to compare with?

:func:`run_plain` runs ``vllm.LLM(**engine_kwargs)`` greedily over the prompts
in a fresh interpreter of its own (this module, run with ``python -m``), with
the environment it is handed: edge's runtime environment and the plan's
process layout, without edge's engine mark (``edge_core.runtime.env.ENGINE_MARK``),
so none of the vLLM plugins edge's backends register act in it. A process of
its own because vLLM loads its plugins once per process and an in-process
engine leaves its imports behind: a reference run in edge's own process would
decide what edge's stage, started there next, gets. Its output goes to the
engine log; the token ids come back in a file. Every process it started is
gone when :func:`run_plain` returns (those it left are ended by the session's
marker, :mod:`.reaper`), so the second engine of ``edge parity`` never starts
beside the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .deaths import account, failure
from .logs import EngineLog
from .processes import KILL_GRACE_S
from .reaper import MARKER, end_marked, marked_processes


def run_plain(engine_kwargs: Mapping[str, Any], prompts: list[str], max_tokens: int, environ: Mapping[str, str],
              engine_log: EngineLog) -> tuple[list[list[int]], dict[str, Any]]:
    """Each prompt's greedy token ids from plain ``vllm.LLM`` in a child interpreter, and what it started and left."""
    with tempfile.TemporaryDirectory(prefix="edge-reference-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"engine_kwargs": dict(engine_kwargs), "prompts": list(prompts),
                                       "max_tokens": max_tokens}), encoding="utf-8")
        log_fd = engine_log.open_fd()
        try:
            # A session (and process group) of its own, as edge's engines: the terminal's Ctrl-C reaches edge only.
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(request), str(result)], env=dict(environ),
                                    stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True)
        finally:
            if log_fd is not None:
                os.close(log_fd)
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            terminated, killed = _end_what_it_left(environ)
        answer = json.loads(result.read_text(encoding="utf-8")) if code == 0 and result.is_file() else None
    if answer is None:
        # Named as every engine death is (an OOM kill included): the child's own status, the cgroup, the kernel.
        detail = "; ".join(engine_log.causes()) or f"the engine log ({engine_log.path or 'the terminal'}) says why"
        deaths = account({proc.pid: code} if code else {}, engine_log)
        raise failure("plain vLLM's reference run ended before it gave its tokens", None, deaths, f": {detail}",
                      engine_log.path)
    leftover = [pid for pid, _ in marked_processes(environ[MARKER])] if MARKER in environ else []
    return answer["token_ids"], {"engine_start_s": answer["engine_start_s"], "pids": [proc.pid],
                                 "leftover_pids": leftover, "terminated_pids": terminated, "killed_pids": killed}


def _end_what_it_left(environ: Mapping[str, str]) -> tuple[list[int], list[int]]:
    """Terminate, then kill, any process the reference run started that outlived it (found by the session marker)."""
    if MARKER not in environ:
        return [], []
    return end_marked(environ[MARKER])


def main(argv: list[str]) -> int:
    """The child: ``vllm.LLM`` with the request's engine arguments, its prompts greedily, the ids to the result file."""
    request_path, result_path = argv
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(**request["engine_kwargs"])
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    outputs = llm.generate(request["prompts"], params, use_tqdm=False)
    ids = [list(out.outputs[0].token_ids) for out in outputs]
    llm.llm_engine.engine_core.shutdown()  # vllm.LLM has no close(): this ends the engine core and its workers
    Path(result_path).write_text(json.dumps({"token_ids": ids, "engine_start_s": round(start_s, 3)}),
                                 encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
