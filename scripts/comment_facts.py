"""Count comment and docstring lines in edge_core and plugins that carry a measurement or a vLLM version.

    python scripts/comment_facts.py [REV] [--list]

Issue 23 asks that measurements, dates and run logs live in the docs (docs/vllm-cpu-facts.md,
docs/benchmarks.md), with a pointer left in the code. This counts the comment and docstring lines
of the tracked ``.py`` files under ``edge_core/`` and ``plugins/`` that match ``measured|0\\.32``,
in the working tree or at git revision REV; ``--list`` prints each line.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import tokenize

PATTERN = re.compile(r"measured|0\.32")


def files(rev: str | None) -> list[str]:
    command = ["git", "ls-tree", "-r", "--name-only", rev] if rev else ["git", "ls-files"]
    names = subprocess.check_output([*command, "edge_core", "plugins"], text=True).split()
    return [name for name in names if name.endswith(".py") and "/build/" not in name]


def source(name: str, rev: str | None) -> str:
    if rev:
        return subprocess.check_output(["git", "show", f"{rev}:{name}"], text=True)
    with open(name, encoding="utf-8") as handle:
        return handle.read()


def hits(text: str) -> list[tuple[int, str]]:
    """(line, text) of each comment or docstring line that matches."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        docstring = token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        if token.type == tokenize.COMMENT or docstring:
            for offset, line in enumerate(token.string.splitlines()):
                if PATTERN.search(line):
                    found[token.start[0] + offset] = line.strip()
    return sorted(found.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="a git revision (default: the working tree)")
    parser.add_argument("--list", action="store_true", help="print each matching line")
    args = parser.parse_args()
    total = 0
    for name in files(args.rev):
        for line, text in hits(source(name, args.rev)):
            total += 1
            if args.list:
                print(f"{name}:{line}: {text[:140]}")
    print(f"comment/docstring lines matching measured|0.32: {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
