"""A conversation with one engine kept up between turns: ``edge chat``'s library half.

:class:`ChatSession` starts the plan's stage once (through
:class:`~edge_core.runtime.session.StageSession`, like every engine start),
keeps the conversation's turns, and sends the whole history as ``messages``
for each answer: the stage renders it through the model's chat template, as
vLLM's ``/v1/chat/completions`` does. An answer interrupted by Ctrl-C is
cancelled in order (epoch retired, abort in the engine, stream closed) and
what was shown of it stays in the history; the chat goes on. Nothing here
reads the terminal or prints: the CLI does (:mod:`edge_core.cli.chat`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import StageError
from ..stream import StageRequest
from .session import StageSession

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry
    from ..stream import CancelReport, DeltaEvent
    from .logs import EngineLog
    from .session import Observer, RequestResult


@dataclass(frozen=True)
class Turn:
    """One question and its answer, as the conversation keeps them."""

    question: str
    answer: str
    finish_reason: str | None
    tokens: int
    time_to_first_token_s: float | None
    decode_tokens_per_s: float | None
    cancelled: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.answer, "finish_reason": self.finish_reason,
                "tokens": self.tokens, "cancelled": self.cancelled,
                "time_to_first_token_s": None if self.time_to_first_token_s is None
                else round(self.time_to_first_token_s, 4),
                "decode_tokens_per_s": None if self.decode_tokens_per_s is None else round(self.decode_tokens_per_s, 2)}


class ContextFull(StageError):
    """The conversation no longer fits the session's context."""


@dataclass
class ChatSession:
    """One plan's stage and a conversation on it; use as a context manager (entering starts the engine)."""

    plan: Plan
    registry: Registry
    observer: Observer | None = None
    engine_log: EngineLog | None = None
    keep_log: bool = False
    system: str | None = None
    max_tokens: int = 512
    temperature: float = 0.0
    seed: int | None = None
    turns: list[Turn] = field(default_factory=list)
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.session = StageSession(self.plan, self.registry, self.observer, engine_log=self.engine_log,
                                    keep_log=self.keep_log)

    def __enter__(self) -> ChatSession:
        self.started_at = time.perf_counter()
        self.session.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.session.__exit__(*exc)

    def messages(self, question: str) -> tuple[dict[str, str], ...]:
        """The history and ``question`` as the stage's ``messages``."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns:
            out += [{"role": "user", "content": turn.question}, {"role": "assistant", "content": turn.answer}]
        out.append({"role": "user", "content": question})
        return tuple(out)

    def ask(self, question: str, on_event: Callable[[DeltaEvent], None] | None = None
            ) -> tuple[Turn, CancelReport | None]:
        """Answer ``question`` with the whole conversation as context, streaming to ``on_event``.

        A KeyboardInterrupt while the answer streams cancels it; the turn is
        kept with what was shown and ``cancelled`` set, and the report of the
        cancel comes back beside it. A conversation grown past the context
        raises :class:`ContextFull` (the history is left as it was).
        """
        request = StageRequest(messages=self.messages(question), max_tokens=self.max_tokens,
                               temperature=self.temperature, seed=self.seed)
        consumer = None
        report = None
        try:
            consumer = self.session.request(request)
            consumer.drain(on_event)
        except KeyboardInterrupt:
            if consumer is None:
                raise
            report = consumer.run.cancel()
        except StageError as exc:
            if _too_long(exc):
                raise ContextFull(
                    f"the conversation ({len(self.turns)} turns and this question) no longer fits the "
                    f"{self.plan.session.max_model_len}-token context") from None
            raise
        assert consumer is not None
        result: RequestResult = consumer.result()
        turn = Turn(question=question, answer=result.text, finish_reason=result.finish_reason,
                    tokens=len(result.token_ids), time_to_first_token_s=result.time_to_first_token_s,
                    decode_tokens_per_s=result.decode_tokens_per_s, cancelled=report is not None)
        self.turns.append(turn)
        return turn, report

    def clear(self) -> None:
        self.turns.clear()

    def memory(self) -> dict[str, Any]:
        return self.session.memory()

    def record(self) -> dict[str, Any]:
        """The chat as a JSON record: its turns and the engine's start; the memory once the session has stopped."""
        return {"turns": [t.to_dict() for t in self.turns], "engine_start_s": round(self.session.start_s, 3),
                "stop_s": round(self.session.stop_s, 3), "stage": self.session.info()}


def _too_long(exc: BaseException) -> bool:
    """vLLM refuses a prompt longer than the context with "... longer than the maximum model length ..."."""
    text = str(exc).lower()
    return "maximum model length" in text or "max_model_len" in text or "too long" in text
