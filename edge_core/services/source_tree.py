"""An installed package's Python source, parsed with ``ast`` and never imported.

``import vllm`` or ``import transformers`` costs seconds and pulls torch; what
``edge devices`` and ``edge plan`` need from either package is read from its
files instead. :class:`SourceTree` is the one reader both use
(:mod:`edge_core.kit.vllm_source` for vLLM's registry and tables,
:mod:`edge_core.artifact.transformers_source` for transformers' configuration
classes): each file parsed once, with the stat of each so a caller keying a
cache on them knows when to re-read.
"""

from __future__ import annotations

import ast
from pathlib import Path

#: Larger files are not package source; refuse to parse them.
MAX_SOURCE_BYTES = 4 << 20


class Unreadable(Exception):
    """A piece of the source is not in the shape a reader knows; the message names file and symbol."""


class SourceTree:
    """The files of one installed package, parsed on first use, with the stat of each.

    ``package`` is the import name (``vllm``, ``transformers``) that dotted
    module names start with; ``label`` names it in messages; ``version`` is the
    installed version when the caller knows it.
    """

    def __init__(self, root: Path | str, package: str = "vllm", label: str = "vLLM",
                 version: str | None = None) -> None:
        self.root = Path(root)
        self.package, self.label, self.version = package, label, version
        self.parsed: dict[str, ast.Module] = {}
        #: (path relative to root, size, mtime_ns) of every file parsed.
        self.files: list[tuple[str, int, int]] = []

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def module(self, rel: str) -> ast.Module:
        """The parsed file ``rel`` (relative to the package); :class:`Unreadable` when it cannot be."""
        if rel in self.parsed:
            return self.parsed[rel]
        path = self.root / rel
        try:
            st = path.stat()
            if st.st_size > MAX_SOURCE_BYTES:
                raise Unreadable(f"{rel}: {st.st_size} bytes is not a {self.label} source file")
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise Unreadable(f"{rel}: cannot be read ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise Unreadable(f"{rel}: is not UTF-8 text") from None
        try:
            tree = ast.parse(text, filename=rel)
        except (SyntaxError, ValueError) as exc:
            raise Unreadable(f"{rel}: does not parse as Python ({exc})") from None
        self.parsed[rel] = tree
        self.files.append((rel, st.st_size, st.st_mtime_ns))
        return tree

    def module_file(self, dotted: str) -> str:
        """``<package>.a.b`` -> ``a/b.py`` (or ``a/b/__init__.py``) relative to the package."""
        parts = dotted.split(".")
        if parts[0] != self.package:
            raise Unreadable(f"{dotted}: not a module of the {self.package} package")
        rel = "/".join(parts[1:])
        return f"{rel}.py" if (self.root / f"{rel}.py").is_file() else f"{rel}/__init__.py"
