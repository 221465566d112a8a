"""The ``edge`` command: parse, call the library, render — and the one place exceptions become exit codes.

Exit codes: 0 success/admitted, 2 refused, 3 parity divergence, 1 internal
error, 64 usage error, 130 interrupted. Every command has ``--json`` with a
versioned schema (docs/json.md). One module per group of commands:
:mod:`.devices` (``plugins``, ``devices``), :mod:`.plan` (``plan``), :mod:`.models` (``models``),
:mod:`.run` (``run``, ``accept``, ``parity``), :mod:`.chat` (``chat``), :mod:`.serve` (``serve``),
:mod:`.sessions` (``ps``, ``stop``), :mod:`.convert` (``import``).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from .._version import __version__
from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ArtifactError, EdgeError, UsageError
from ..runtime.documents import SCHEMA_VERSION
from ..services.registry import PROBE_THREAD_PREFIX
from ._common import ArgumentError, Parser
from .chat import add_chat_command
from .convert import add_import_command
from .devices import add_device_commands
from .models import add_models_command
from .plan import add_plan_command
from .run import add_run_commands
from .serve import add_serve_command
from .sessions import add_session_commands

__all__ = ["SCHEMA_VERSION", "build_parser", "console_main", "main"]


def build_parser() -> Parser:
    parser = Parser(
        prog="edge",
        description=(
            "Decide, before loading anything, which device this interpreter can run a model "
            "checkpoint on and with how many bytes; refuse with a reason and a remedy when none can."
        ),
        epilog=("exit codes: 0 ok/admitted, 2 refused, 3 parity divergence, 1 internal error, 64 usage error, "
                "130 interrupted"),
    )
    parser.add_argument("--version", action="version", version=f"edge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    add_device_commands(sub)
    add_plan_command(sub)
    add_models_command(sub)
    add_run_commands(sub)
    add_chat_command(sub)
    add_serve_command(sub)
    add_import_command(sub)
    add_session_commands(sub)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if args.command is None:
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            parser.print_help()
            return EXIT_USAGE
        if extra:  # the command's own parser says it, with the command's usage
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.handler(args))
    except ArgumentError as exc:  # already "edge COMMAND: ..."
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"edge: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ArtifactError as exc:  # refused before any plan could say so (the demo model cannot be built)
        print(f"edge: [{exc.code}] {exc.message}\nedge: remedy: {exc.remedy}", file=sys.stderr)
        return exc.exit_code
    except EdgeError as exc:
        cause = exc.__cause__ if exc.exit_code == EXIT_INTERNAL else None  # a plugin's or a runtime's fault
        if cause is not None and os.environ.get("EDGE_DEBUG"):
            traceback.print_exception(cause)
        print(f"edge: {exc}", file=sys.stderr)
        if cause is not None and not os.environ.get("EDGE_DEBUG") and getattr(exc, "traceback_helps", True):
            print("edge: rerun with EDGE_DEBUG=1 for the traceback", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("edge: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # a bug in edge: say so plainly, keep the traceback behind a flag
        if os.environ.get("EDGE_DEBUG"):
            raise
        print(
            f"edge: internal error: {type(exc).__name__}: {exc}\n"
            "This is a bug in edge; rerun with EDGE_DEBUG=1 for the traceback and report it.",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


#: The runtimes an engine command imports. Such a command ends by :func:`exit_now`: a normal shutdown would
#: spend seconds freeing their modules, and with its objects frozen nanobind (triton's binding) would
#: report each one as "leaked" on stderr, ~27 lines after the command's result.
RUNTIME_MODULES = ("torch", "triton", "vllm", "onnxruntime")


def console_main() -> int:
    """The ``edge`` executable (and ``python -m edge_core``): :func:`main`, after which the process ends.

    Two ways to end, both skipping work that finds nothing to do:

    * no runtime imported (``devices``, ``plan``, ...): the interpreter's
      shutdown would walk every object still tracked (~23,000 after a plan,
      ~20 ms of a 0.14 s ``edge plan``) for nothing worth finalizing, so they
      are frozen first; the rest of the shutdown runs as usual.
    * a runtime imported (:data:`RUNTIME_MODULES`: ``run``, ``serve``,
      ``accept``, ``parity``): tearing down torch and vLLM's modules took
      2.3 s after the result was printed (docs/benchmarks.md, "Exit after the
      result"). :func:`exit_now` runs what that shutdown does that matters
      (threads joined, atexit handlers, streams flushed) and ends the process.

    Not in :func:`main`, which tests call in-process.
    """
    code = main()
    if any(name in sys.modules for name in RUNTIME_MODULES) or abandoned_probes():
        exit_now(code)
    gc.freeze()
    return code


def abandoned_probes() -> list[str]:
    """The probe threads still running: a plugin's ``probe_devices`` past its time limit, maybe inside a native
    import. The interpreter's shutdown tears modules down under such a thread (a SIGSEGV after the result was
    printed, seen under load in CI); :func:`exit_now` leaves it be."""
    return [t.name for t in threading.enumerate() if t.name.startswith(PROBE_THREAD_PREFIX) and t.is_alive()]


def exit_now(code: int) -> NoReturn:
    """End the process the way the interpreter would, without tearing down its modules.

    Non-daemon threads are joined and the atexit handlers run (multiprocessing's
    reaping of its children, ``weakref.finalize`` clean-ups such as temporary
    folders, logging's flush), then stdout and stderr are flushed and the process
    exits with ``code``. What is skipped is freeing each module's objects one by
    one, which an exiting process's kernel does at once.
    """
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)
