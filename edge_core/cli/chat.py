"""``edge chat``: a conversation in the terminal, the engine started once and kept up between turns.

Parse, plan (a refusal exits 2 before anything loads), start a
:class:`~edge_core.runtime.chat.ChatSession`, then read questions and stream
answers. Ctrl-C stops the answer being written and keeps the chat; Ctrl-C at
the prompt says how to leave; Ctrl-D or ``/bye`` leaves (exit 0) after the
engine has stopped, nothing left running.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_OK, EXIT_REFUSED
from ._common import mask_option, plugin_options, positive_int, write_document
from .plan import planning_options
from .progress import TerminalObserver, say
from .run import (
    budget_lines,
    chat_template_of,
    engine_log_from,
    engine_log_options,
    plan_here,
    print_plan_beside,
    printable,
)
from .run import temperature as temperature_type

if TYPE_CHECKING:
    from ..runtime.chat import ChatSession
    from ..stream import DeltaEvent

#: What the prompt looks like (ollama's, so hands that know one know the other).
PROMPT = ">>> "
HELP = ("/bye (or Ctrl-D) leaves; /clear forgets the conversation so far; /help shows this. Ctrl-C stops an "
        "answer and keeps the chat.")


def add_chat_command(sub: Any) -> None:
    chat = sub.add_parser(
        "chat", help="talk to the model in the terminal; the engine stays up between turns",
        description=("Plan first (a refusal exits 2 before anything loads), start the engine once, then answer "
                     "each line you type with the whole conversation as context, through the model's chat "
                     "template, streaming the answer. Ctrl-C stops an answer and keeps the chat; Ctrl-D or /bye "
                     "leaves with exit 0 once the engine has stopped. " + HELP),
    )
    chat.add_argument("--json", metavar="FILE", help="when the chat ends, write its record (turns, timings, "
                                                      "memory) to FILE ('-' for stdout)")
    plugin_options(chat)
    mask_option(chat)
    planning_options(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation (default: the "
                                                         "chat template's own, if it has one)")
    chat.add_argument("--max-tokens", type=positive_int, default=512, metavar="N",
                      help="tokens per answer at most (512)")
    chat.add_argument("--temperature", type=temperature_type, default=0.0, metavar="T", help="0 = greedy (default)")
    chat.add_argument("--seed", type=int, metavar="N", help="sampling seed (with --temperature > 0)")
    engine_log_options(chat)
    chat.set_defaults(handler=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    plan, registry, plan_s = plan_here(args)
    if not plan.admitted:
        print_plan_beside(plan, plan_s, args.json, args.explain)
        write_document({"outcome": "refused", "plan": plan.to_dict()}, "chat", args.json)
        return EXIT_REFUSED
    if chat_template_of(plan) is None:
        say(f"edge: {plan.model_path} has no chat template (a base model): there is no conversation format to "
            "follow; use `edge run --raw --prompt TEXT` to complete text instead")
        return EXIT_REFUSED
    if (getattr(args, "nnodes", 1) or 1) > 1:
        say("edge: chat runs on one node; across nodes use `edge serve` and a chat client")
        return EXIT_REFUSED
    from ..runtime.chat import ChatSession

    print_plan_beside(plan, plan_s, args.json, args.explain)
    engine_log, keep = engine_log_from(args, "chat")
    chat = ChatSession(plan, registry, TerminalObserver(), engine_log=engine_log, keep_log=keep, system=args.system,
                       max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    with chat:
        say(f"edge: ready. {HELP}")
        converse(chat)
    memory = chat.memory()
    if args.json:
        write_document({"outcome": "ended", "model": plan.model_path, **chat.record(), "memory": memory,
                        "plan": plan.to_dict()}, "chat", args.json)
    else:
        for line in budget_lines(memory):
            say("edge: " + line)
    return EXIT_OK


def converse(chat: ChatSession) -> None:
    """Read questions until Ctrl-D or /bye; stream each answer."""
    from ..runtime.chat import ContextFull

    out = sys.stdout
    try:
        import readline  # noqa: F401 - line editing and history for input(), where the platform has it
    except ImportError:
        pass

    def show(event: DeltaEvent) -> None:
        if event.text:
            out.write(printable(event.text))
            out.flush()

    while True:
        try:
            question = input(PROMPT)
        except EOFError:  # Ctrl-D
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            say("edge: use Ctrl-D or /bye to leave")
            continue
        text = question.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            return
        if text == "/help":
            say(f"edge: {HELP}")
            continue
        if text == "/clear":
            chat.clear()
            say("edge: the conversation so far is forgotten")
            continue
        try:
            turn, report = chat.ask(question, show)
        except ContextFull as exc:
            say(f"edge: {exc}: /clear starts over (or restart with a larger --max-model-len, or --max-model-len auto: "
                "the longest context that fits)")
            continue
        out.write("\n" if not turn.answer.endswith("\n") else "")
        if report is not None:
            say(f"edge: answer stopped after {turn.tokens} tokens; the chat goes on")
        elif turn.finish_reason == "length":
            say(f"edge: the answer reached --max-tokens ({chat.max_tokens}) and was cut")
        out.write("\n")
        out.flush()
