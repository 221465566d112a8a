"""How long an ``edge`` command lives after printing its result (issue 22).

Runs the command, timestamps each line of its stdout as it arrives, and prints
when the last one came and how long the process took to end after it:

    python bench/exit_lag.py edge run --max-tokens 8 --json --prompt hello

An engine command (``run``, ``accept``, ``parity``) prints its JSON last, so
``exit_lag`` is the time spent ending the process after the result.
"""

from __future__ import annotations

import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 64
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    last = None
    for _line in proc.stdout:
        last = time.monotonic()
    errors = proc.stderr.read()
    code = proc.wait()
    ended = time.monotonic()
    result_at = (last - started) if last is not None else float("nan")
    lag = (ended - last) if last is not None else float("nan")
    print(f"exit code {code}, total {ended - started:.2f} s, last stdout line at {result_at:.2f} s, "
          f"exit_lag {lag:.2f} s")
    if code:
        print(errors[-2000:], file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
