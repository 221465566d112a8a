"""The stream types every backend uses: what a stage is asked, what it yields, and the state it owns.

Independent of any engine:

* :class:`StageRequest` — one request to a started stage;
* :class:`DeltaEvent` — only what is new since the previous event, a sequence
  number that exposes loss, and an epoch that can be retired;
* :class:`StateHandle` — an opaque reference to backend-owned state (the KV
  cache), tied to the artifact that produced it and never usable from another
  backend;
* :class:`CancelReport` — what cancelling a request did, in order.

The machinery that drives a request (the bounded queue, the sequence check,
the producer thread) is the runtime's: :mod:`edge_core.runtime.stream_run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import StageError

#: Bytes charged per token id by :attr:`DeltaEvent.size_bytes` (an int64 id).
TOKEN_ID_BYTES = 8

FINISH_REASONS = ("stop", "length", "abort", "error")


def new_request_id() -> str:
    """Return a fresh request id, unique within and across processes."""
    import uuid  # on first use: importing it costs every command ~1.5 ms

    return f"req-{uuid.uuid4().hex[:16]}"


def _payload_nbytes(value: Any) -> int:
    """Bytes held by one tensor payload: numpy/torch arrays, bytes, memoryviews."""
    if value is None:
        return 0
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return memoryview(value).nbytes
    except TypeError:
        raise TypeError(
            f"tensor payload of type {type(value).__name__} has neither .nbytes nor the "
            "buffer protocol; pass a numpy array, bytes or a memoryview"
        ) from None


def _describe_payload(value: Any) -> dict[str, Any]:
    """JSON-safe description of a tensor payload (never the data itself)."""
    out: dict[str, Any] = {"nbytes": _payload_nbytes(value)}
    shape = getattr(value, "shape", None)
    if shape is not None:
        out["shape"] = [int(d) for d in shape]
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype)
    return out


@dataclass(frozen=True)
class DeltaEvent:
    """What a stage produced since its previous event for one request.

    ``token_ids`` and ``text`` carry only the new tokens and the new text, never
    the running total. ``seq`` counts events of one (request, epoch) from 0, so
    a consumer sees a hole as a jump. ``epoch`` names the attempt: once retired,
    no event of it reaches the consumer. ``finish_reason`` is None until the
    last event. ``tensors`` is for stages whose output is not tokens (an ONNX
    graph stage returns named arrays): name -> array-like or bytes-like.
    """

    request_id: str
    epoch: int
    seq: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    tensors: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        problems = []
        if not isinstance(self.epoch, int) or self.epoch < 0:
            problems.append(f"epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.seq, int) or self.seq < 0:
            problems.append(f"seq must be a non-negative int, got {self.seq!r}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            problems.append(f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
        if problems:
            raise ValueError(f"invalid delta event for request {self.request_id!r}: " + "; ".join(problems))

    @property
    def size_bytes(self) -> int:
        """Approximate payload bytes, the unit of the runtime's bounded stream's byte bound."""
        size = len(self.text.encode("utf-8")) + TOKEN_ID_BYTES * len(self.token_ids)
        if self.tensors:
            size += sum(_payload_nbytes(v) for v in self.tensors.values())
        return size

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "tensors": (
                None if self.tensors is None
                else {name: _describe_payload(v) for name, v in self.tensors.items()}
            ),
            "size_bytes": self.size_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """One request to a started stage.

    A text stage takes ``prompt`` (sent as it is), ``prompt_token_ids``, or
    ``messages``: a conversation of ``{"role", "content"}`` turns the stage
    renders through the model's own chat template, with the opening of the
    assistant's turn (what an OpenAI-compatible server does for
    ``/v1/chat/completions``). A graph stage takes ``inputs`` (name ->
    array-like). ``epoch`` is stamped by the backend on every
    event it yields for this request; a retry of the same request id uses a new
    epoch so events of the abandoned attempt can be fenced off.
    """

    request_id: str = field(default_factory=new_request_id)
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    inputs: Mapping[str, Any] | None = None
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None and not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        problems = []
        given = [name for name in ("prompt", "prompt_token_ids", "messages", "inputs")
                 if getattr(self, name) is not None]
        if not given:
            problems.append("give prompt, prompt_token_ids, messages or inputs")
        elif len(given) > 1 and "inputs" not in given:
            problems.append(f"give one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
        for turn in self.messages or ():
            if not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str) \
                    or not isinstance(turn.get("content"), str):
                problems.append(f"each message is {{'role': str, 'content': str}}, got {turn!r}")
                break
        if self.messages is not None and not self.messages:
            problems.append("messages is empty")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            problems.append(f"epoch must be a non-negative int, got {self.epoch!r}")
        if problems:
            raise ValueError(f"invalid stage request {self.request_id!r}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": None if self.prompt_token_ids is None else list(self.prompt_token_ids),
            "messages": None if self.messages is None else [dict(turn) for turn in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "inputs": (
                None if self.inputs is None
                else {name: _describe_payload(v) for name, v in self.inputs.items()}
            ),
            "epoch": self.epoch,
        }


@dataclass(frozen=True)
class StateHandle:
    """Opaque reference to state a backend owns (a stage's KV cache).

    ``ref`` means something only to the backend that issued it; the handle is
    tied to the artifact that produced the state and is never migratable
    between backends.
    """

    backend: str
    device_id: str
    artifact_id: str
    ref: str

    def check_compatible(self, backend: str, artifact_id: str) -> None:
        """Raise :class:`StageError` unless ``backend`` and ``artifact_id`` own this state."""
        if backend != self.backend:
            raise StageError(
                f"state {self.ref!r} belongs to backend {self.backend!r} on {self.device_id}, "
                f"not {backend!r}: backend state is never migratable between backends; "
                f"re-run the prompt on {backend!r} to rebuild it there"
            )
        if artifact_id != self.artifact_id:
            raise StageError(
                f"state {self.ref!r} on {self.device_id} was produced by artifact "
                f"{self.artifact_id!r}, not {artifact_id!r}: a KV cache is only valid for "
                "the weights that computed it; re-run the prompt with this artifact"
            )

    def to_dict(self) -> dict[str, str]:
        return {
            "backend": self.backend,
            "device_id": self.device_id,
            "artifact_id": self.artifact_id,
            "ref": self.ref,
        }


#: What a cancel report says about memory, because it is the first thing people misread.
CANCEL_MEMORY_NOTE = (
    "cancel frees the request's in-flight work, not device memory: an engine that "
    "pre-allocates its KV pool (vLLM does) keeps it, so the device counter does not drop; "
    "what drops is the in-flight count"
)


@dataclass(frozen=True)
class CancelReport:
    """What ``StreamRun.cancel`` (:mod:`edge_core.runtime.stream_run`) did, in the order it did it.

    ``steps`` lists the steps taken (``retire``, ``abort``, ``close``,
    ``join``); ``discarded_by_fence`` and ``events_delivered`` are counted when
    cancel returned. ``producer_joined`` is False when the backend was still
    unwinding after ``join_timeout_s``: the caller was not held, cleanup goes
    on in the background.
    """

    request_id: str
    epoch: int
    was_in_flight: bool
    steps: tuple[str, ...]
    discarded_by_fence: int
    events_delivered: int
    abort_returned: Any
    abort_error: str | None
    producer_joined: bool
    join_timeout_s: float
    cancel_to_closed_s: float
    cancel_to_return_s: float
    note: str = CANCEL_MEMORY_NOTE

    def to_dict(self) -> dict[str, Any]:
        abort_returned = self.abort_returned
        if not isinstance(abort_returned, (bool, int, float, str, type(None))):
            abort_returned = repr(abort_returned)
        return {
            "request_id": self.request_id,
            "epoch": self.epoch,
            "was_in_flight": self.was_in_flight,
            "steps": list(self.steps),
            "discarded_by_fence": self.discarded_by_fence,
            "events_delivered": self.events_delivered,
            "abort_returned": abort_returned,
            "abort_error": self.abort_error,
            "producer_joined": self.producer_joined,
            "join_timeout_s": self.join_timeout_s,
            "cancel_to_closed_s": self.cancel_to_closed_s,
            "cancel_to_return_s": self.cancel_to_return_s,
            "note": self.note,
        }
