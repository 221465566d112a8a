"""vLLM's synchronous engine driven as the stage's async engine, in edge's process (edge_core/runtime/vllm_inproc.py).

The boundary is faked: an engine with ``LLMEngine``'s methods (``add_request``,
``step``, ``abort_request``, ``engine_core.shutdown``) that emits one token per
step per request, the way vLLM's step returns ``RequestOutput`` deltas.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from edge_core.runtime.vllm_inproc import InProcessEngine


class FakeEngine:
    """One token a step for each request in flight; ``fail_at`` makes that step raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.model_config, self.renderer = "model config", "renderer"
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at = fail_at
        self.engine_core = types.SimpleNamespace(shutdown=lambda: setattr(self, "shut", True))
        self.shut = False

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = params["max_tokens"]

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.aborted.append(rid)
            self.requests.pop(rid, None)

    def step(self):
        self.steps += 1
        if self.fail_at == self.steps:
            raise RuntimeError("Unsupported CPU attention configuration")
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            finished = self.requests[rid] == 0
            outputs.append(types.SimpleNamespace(request_id=rid, finished=finished, token=self.steps))
            if finished:
                del self.requests[rid]
        return outputs


async def collect(engine: InProcessEngine, rid: str, n: int, stop_after: int | None = None) -> list[int]:
    got = []
    generator = engine.generate("prompt", {"max_tokens": n}, rid)
    async for out in generator:
        got.append(out.token)
        if stop_after is not None and len(got) == stop_after:
            await generator.aclose()
            break
    return got


def test_it_has_the_face_the_stage_reads():
    engine = InProcessEngine(FakeEngine())
    assert (engine.model_config, engine.renderer) == ("model config", "renderer")


def test_requests_stream_one_output_a_step_and_end_with_the_finished_one():
    fake = FakeEngine()
    engine = InProcessEngine(fake)

    async def main():
        return await asyncio.gather(collect(engine, "a", 3), collect(engine, "b", 5))

    a, b = asyncio.run(main())
    assert a == [1, 2, 3] and b == [1, 2, 3, 4, 5]  # batched: both stepped together
    assert fake.steps == 5 and fake.aborted == []


def test_closing_a_generator_early_aborts_its_request_in_the_engine():
    fake = FakeEngine()
    engine = InProcessEngine(fake)
    assert asyncio.run(collect(engine, "a", 10, stop_after=2)) == [1, 2]
    assert fake.aborted == ["a"] and not fake.requests


def test_abort_ends_the_generator_without_a_last_output():
    fake = FakeEngine()
    engine = InProcessEngine(fake)

    async def main():
        task = asyncio.ensure_future(collect(engine, "a", 100))
        while fake.steps < 3:
            await asyncio.sleep(0)
        await engine.abort("a")
        return await task

    got = asyncio.run(main())
    assert 3 <= len(got) < 100 and fake.aborted == ["a"]


def test_an_engine_error_reaches_every_request_in_flight():
    engine = InProcessEngine(FakeEngine(fail_at=2))

    async def main():
        return await asyncio.gather(collect(engine, "a", 5), collect(engine, "b", 5), return_exceptions=True)

    for result in asyncio.run(main()):
        assert isinstance(result, RuntimeError) and "attention configuration" in str(result)


def test_shutdown_ends_the_requests_and_the_engine_core_and_refuses_new_ones():
    fake = FakeEngine()
    engine = InProcessEngine(fake)

    async def main():
        task = asyncio.ensure_future(collect(engine, "a", 100))
        while fake.steps < 2:
            await asyncio.sleep(0)
        engine.shutdown()
        got = await task
        with pytest.raises(RuntimeError, match="shut down"):
            await collect(engine, "b", 1)
        return got

    assert len(asyncio.run(main())) < 100 and fake.shut
