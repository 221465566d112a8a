"""How does vLLM's engine run inside edge's own process, driven the way the stage drives its async engine?

vLLM 0.32 runs its engine core in the caller's process only under its
synchronous ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an
``InprocClient`` over ``EngineCore`` with the uniprocess executor, so the
worker runs in the same thread); its ``AsyncLLM`` always spawns the engine
core. :class:`InProcessEngine` gives the stage (:class:`~edge_core.runtime.vllm_engine.VllmStage`)
the part of ``AsyncLLM`` it uses — ``generate`` (an async generator of
``RequestOutput``), ``abort``, ``shutdown``, ``get_num_unfinished_requests``,
``renderer``, ``model_config`` —
over an ``LLMEngine``, all on the stage's one event loop: a step task calls
``LLMEngine.step()`` while requests are in flight and hands each output to
its request's queue. Everything that touches the engine runs on that loop's
thread, so the engine, which is not thread-safe, is only ever used from one
thread; a step blocks the loop for one forward pass, so an abort waits at
most that long. vLLM is imported by the caller (:mod:`.vllm_stage`), not here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

#: Put in a request's queue when it was aborted: vLLM's synchronous engine gives an aborted request no last output.
_ABORTED = object()


class InProcessEngine:
    """``vllm.v1.engine.llm_engine.LLMEngine`` (engine core in this process) with ``AsyncLLM``'s face, on one loop."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.renderer = engine.renderer
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._stepping: asyncio.Task[None] | None = None
        self._closed = False

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """Add the request and yield its outputs as the step task produces them; closing it early aborts it."""
        if self._closed:
            raise RuntimeError("the in-process vLLM engine was shut down")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.engine.add_request(request_id, prompt, params)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._step_soon()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = bool(item.finished)
                yield item
        finally:
            if self._queues.pop(request_id, None) is not None and not finished:
                self.engine.abort_request([request_id])

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine; its generator ends without a last output."""
        queue = self._queues.pop(request_id, None)
        self.engine.abort_request([request_id])
        if queue is not None:
            queue.put_nowait(_ABORTED)

    def get_num_unfinished_requests(self) -> int:
        """vLLM's own count of unfinished requests (its output processor's)."""
        return int(self.engine.get_num_unfinished_requests())

    def _step_soon(self) -> None:
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.get_running_loop().create_task(self._step_while_busy(), name="edge-vllm-steps")

    async def _step_while_busy(self) -> None:
        """Step the engine while any request is in flight; an engine error ends every request with it."""
        while self._queues and not self._closed:
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the engine failed: every request in flight learns why
                for waiting in self._queues.values():
                    waiting.put_nowait(exc)
                self._queues.clear()
                return
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            await asyncio.sleep(0)  # new requests, aborts and readers run between steps

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request in flight and shut the engine core (and its in-process worker) down."""
        self._closed = True
        for queue in self._queues.values():
            queue.put_nowait(_ABORTED)
        self._queues.clear()
        if self._stepping is not None:
            self._stepping.cancel()
        self.engine.engine_core.shutdown()
