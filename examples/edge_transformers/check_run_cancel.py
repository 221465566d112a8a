"""End to end through the CLI: `edge run --backend transformers` streams, then Ctrl-C cancels it cleanly.

    python examples/edge_transformers/check_run_cancel.py [EDGE_COMMAND ...]   (default: edge)

Starts a long greedy run on the bundled demo checkpoint, waits for the first
streamed text, sends SIGINT, and exits 0 only when edge exits 130 (cancelled)
having reported the cancel. Used by `nox -s example`; the waits are for
output, never for time.
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main(edge: list[str]) -> int:
    cmd = [*edge, "run", "--backend", "transformers", "--prompt", "Once upon a time",
           "--max-tokens", "1500", "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0)
    plan = ""
    while "nothing loaded" not in plan:  # the plan's last line; streamed text follows
        line = proc.stdout.readline()
        if not line:
            return _fail(proc, "edge run ended before it had planned")
        plan += line
    streamed = ""
    while not streamed.strip():
        char = proc.stdout.read(1)
        if not char:
            return _fail(proc, "edge run ended before it streamed any text")
        streamed += char
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)  # hang guard only
    print(f"streamed before the cancel: {streamed!r}\n{out.strip()}\n{err.strip()}")
    if proc.returncode != 130 or "cancelled request" not in err:
        print(f"expected exit 130 and a cancel report, got exit {proc.returncode}", file=sys.stderr)
        return 1
    return 0


def _fail(proc: subprocess.Popen, why: str) -> int:
    code = proc.wait()
    print(f"{why} (exit {code}):\n{proc.stderr.read()[-2000:]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["edge"]))
