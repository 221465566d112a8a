"""One text stage run by Hugging Face transformers in this process, token by token.

torch and transformers are imported here, when a stage starts, never when the
backend is probed. A stage serves requests one forward pass at a time (a
lock around the model call): two requests interleave per token rather than
one waiting for the other to finish, and a cancel never waits for a lock.
"""

from __future__ import annotations

import gc
import inspect
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edge_core.errors import StageError
from edge_core.stream import DeltaEvent, StageRequest, StateHandle

from ._probe import BACKEND

#: Checkpoint dtype (as the manifest names it) -> torch dtype attribute. Loading in the
#: checkpoint's own dtype keeps the weights memory-mapped instead of copied.
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

#: Text held back while it ends inside an unfinished UTF-8 sequence (byte-level BPE).
_REPLACEMENT = "\ufffd"


@dataclass
class TransformersStage:
    """The handle ``start_stage`` returns; opaque to the core apart from ``state`` and ``executed_on``."""

    state: StateHandle
    executed_on: str
    model_path: str
    max_model_len: int
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    eos_token_ids: frozenset[int] = frozenset()
    #: Extra forward() arguments: only the last position's logits when the model supports it.
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    _model_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _inflight: dict[str, threading.Event] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": BACKEND, "executed_on": self.executed_on, "model_path": self.model_path,
                "max_model_len": self.max_model_len, "state": self.state.to_dict(), "stopped": self.stopped}


def _eos_ids(model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def start(device: Any, plan: Any) -> TransformersStage:
    manifest = plan.manifest
    if manifest is None or manifest.kind == "onnx" or manifest.weight_format != "dense":
        fmt = getattr(manifest, "weight_format", None)
        raise StageError(f"{BACKEND} runs dense safetensors checkpoints, not {fmt!r} ({plan.model_path})")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # edge reports its own progress
    dtype = getattr(torch, _DTYPES.get(manifest.dtype or "", "float32"))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            manifest.path, dtype=dtype, local_files_only=True, trust_remote_code=False)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            manifest.path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise StageError(
            f"transformers could not load {manifest.path}: {type(exc).__name__}: {exc}; "
            "check that the directory holds config.json, tokenizer files and safetensors weights"
        ) from exc
    model.eval()
    accepts = inspect.signature(model.forward).parameters
    forward_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
    return TransformersStage(
        state=StateHandle(backend=device.backend or BACKEND, device_id=device.device_id,
                          artifact_id=manifest.artifact_id, ref=f"hf-{uuid.uuid4().hex[:12]}"),
        executed_on=device.device_id,
        model_path=manifest.path,
        max_model_len=int(plan.session.max_model_len),
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model),
        forward_kwargs=forward_kwargs,
    )


def _chat_ids(tokenizer: Any, request: StageRequest) -> list[int]:
    """A conversation rendered by the model's own chat template, the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(f"request {request.request_id} is a conversation, and this model's tokenizer has no "
                         "chat template; send a prompt instead")
    text = tokenizer.apply_chat_template([dict(turn) for turn in request.messages or ()], tokenize=False,
                                         add_generation_prompt=True)
    # The template writes the special tokens (BOS among them) itself.
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def stream(stage: TransformersStage, request: StageRequest) -> Iterator[DeltaEvent]:
    """Validate and register ``request`` now (so a cancel before the first token counts); generate lazily."""
    if stage.stopped:
        raise StageError(f"{BACKEND} stage on {stage.executed_on} is stopped; start a new one")
    if request.inputs is not None and all(
            text is None for text in (request.prompt, request.prompt_token_ids, request.messages)):
        raise StageError(f"{BACKEND} runs text stages; request {request.request_id} carries tensors only")
    if request.prompt_token_ids is not None:
        prompt_ids = [int(t) for t in request.prompt_token_ids]
    elif request.messages is not None:
        prompt_ids = _chat_ids(stage.tokenizer, request)
    else:
        prompt_ids = list(stage.tokenizer(request.prompt).input_ids)
    if not prompt_ids:
        raise StageError(f"request {request.request_id}: the prompt tokenizes to nothing")
    if len(prompt_ids) + request.max_tokens > stage.max_model_len:
        raise StageError(
            f"request {request.request_id}: {len(prompt_ids)} prompt tokens + max_tokens {request.max_tokens} "
            f"exceed the planned max_model_len {stage.max_model_len}; lower --max-tokens or plan a longer context"
        )
    cancelled = threading.Event()
    with stage._guard:
        if request.request_id in stage._inflight:
            raise StageError(f"request {request.request_id} is already running on this stage")
        stage._inflight[request.request_id] = cancelled
    return _generate(stage, stage.tokenizer, request, prompt_ids, cancelled)


def _pick(logits: Any, request: StageRequest, generator: Any) -> int:
    import torch

    if request.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / request.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _generate(stage: TransformersStage, tokenizer: Any, request: StageRequest, prompt_ids: list[int],
              cancelled: threading.Event) -> Iterator[DeltaEvent]:
    import torch

    def event(seq: int, tokens: tuple[int, ...], text: str, finish: str | None) -> DeltaEvent:
        return DeltaEvent(request.request_id, request.epoch, seq, tokens, text, finish)

    generator = None
    if request.seed is not None:
        generator = torch.Generator().manual_seed(request.seed)
    generated: list[int] = []
    emitted = ""
    cache = None
    input_ids = torch.tensor([prompt_ids])
    try:
        for seq in range(request.max_tokens):
            with stage._model_lock:
                # Checked under the lock so a stop that has dropped the model is seen here.
                if cancelled.is_set() or stage.stopped:
                    yield event(seq, (), "", "abort")
                    return
                with torch.inference_mode():
                    out = stage.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                                      **stage.forward_kwargs)
                cache = out.past_key_values
                token = _pick(out.logits[0, -1].float(), request, generator)
                del out
            if cancelled.is_set():  # cancelled during the forward pass: the token is never shown
                yield event(seq, (), "", "abort")
                return
            generated.append(token)
            finish = None
            if not request.ignore_eos and token in stage.eos_token_ids:
                finish = "stop"
            elif len(generated) == request.max_tokens:
                finish = "length"
            # The tokenizer was taken when the request started: stop() may drop the stage's.
            text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            delta = ""
            if finish is not None or not text.endswith(_REPLACEMENT):
                delta, emitted = text[len(emitted):], text
            yield event(seq, (token,), delta, finish)
            if finish is not None:
                return
            input_ids = torch.tensor([[token]])
    finally:
        with stage._guard:
            if stage._inflight.get(request.request_id) is cancelled:
                del stage._inflight[request.request_id]


def cancel(stage: TransformersStage, request_id: str) -> bool:
    """Flag ``request_id``; generation stops at the next token boundary. Never blocks."""
    with stage._guard:
        flag = stage._inflight.pop(request_id, None)
    if flag is None or flag.is_set():
        return False
    flag.set()
    return True


def stop(stage: TransformersStage) -> bool:
    """Abort every request, then drop the model once no forward pass is running."""
    with stage._guard:
        flags = list(stage._inflight.values())
        stage._inflight.clear()
    for flag in flags:
        flag.set()
    with stage._model_lock:  # held at most for the forward pass in progress
        stage.stopped = True
        stage.model = None
        stage.tokenizer = None
    gc.collect()
    return True
