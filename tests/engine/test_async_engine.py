"""The asyncio API: concurrent streams, abort, stats."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedweight.common.errors import EngineDeadError, UserError
from pagedweight.engine.async_engine import AsyncEngine
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from tests.conftest import BUNDLED_MODEL


@pytest.fixture(scope="module")
def model():
    return load_model(BUNDLED_MODEL, dtype=torch.float32)


def make_async(model, num_blocks=256):
    config = EngineConfig(kv=KVCacheConfig(block_size=4), num_kv_blocks=num_blocks)
    return AsyncEngine(Engine(model, config=config))


async def collect(stream):
    tokens, last = [], None
    async for out in stream:
        tokens.extend(out.new_token_ids)
        last = out
    return tokens, last


def test_streams_deliver_the_same_tokens_as_generate(model):
    prompts = [[5, 6, 7, 8], list(range(10, 31)), [99]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 3, 9)]
    expected = [generate(model, p, sp).token_ids for p, sp in zip(prompts, params)]

    async def main():
        engine = make_async(model)
        results = await asyncio.gather(
            *(collect(engine.add_request(p, sp)) for p, sp in zip(prompts, params))
        )
        stats = engine.stats()
        await engine.close()
        return results, stats

    results, stats = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    assert stats.num_finished == 3 and stats.num_running == 0 and stats.kv_num_used_blocks == 0
    assert stats.num_output_tokens == sum(len(e) for e in expected)


def test_abort_ends_the_stream_and_frees_blocks(model):
    async def main():
        engine = make_async(model)
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), "long")
        other = engine.add_request([4, 5], SamplingParams(max_tokens=4, ignore_eos=True), "short")
        got = []
        async for out in stream:
            got.append(out)
            if len(got) == 3:
                engine.abort("long")
        short_tokens, _ = await collect(other)
        for _ in range(50):  # let the loop settle after its last step
            if engine.stats().kv_num_used_blocks == 0 and not engine.engine.has_work:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        await engine.close()
        return got, short_tokens, stats

    got, short_tokens, stats = asyncio.run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert 3 <= len(got) < 500
    assert len(short_tokens) == 4
    assert stats.kv_num_used_blocks == 0


def test_closing_a_stream_early_aborts_its_request(model):
    async def main():
        engine = make_async(model)
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), "x")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not engine.engine.has_work:
                break
            await asyncio.sleep(0.01)
        has_work = engine.engine.has_work
        await engine.close()
        return has_work

    assert asyncio.run(main()) is False


def test_bad_requests_fail_at_add(model):
    async def main():
        engine = make_async(model, num_blocks=2)
        with pytest.raises(UserError):
            engine.add_request([], SamplingParams())
        with pytest.raises(UserError):
            engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=10))
        await engine.close()

    asyncio.run(main())


class _FailingStep:
    """Wraps a real engine; its n-th step raises (a bug in the step, as far as the loop knows)."""

    def __init__(self, engine, fail_on_step):
        self._engine, self.fail_on_step = engine, fail_on_step
        self.calls = 0

    def step(self):
        self.calls += 1
        if self.calls >= self.fail_on_step:
            raise RuntimeError("boom in step")
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_failed_step_kills_the_engine_and_every_request_fails_fast(model):
    config = EngineConfig(kv=KVCacheConfig(block_size=4), num_kv_blocks=256)
    failing = _FailingStep(Engine(model, config=config), fail_on_step=3)

    async def main():
        engine = AsyncEngine(failing)
        assert not engine.errored and engine.dead_error is None
        engine.check_health()
        streams = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
                   for _ in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert isinstance(results[0].__cause__, RuntimeError) and "boom in step" in str(results[0])
        assert engine.errored and isinstance(engine.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):  # later adds fail at once, nothing is queued
            engine.add_request([1, 2], SamplingParams(max_tokens=2))
        engine.abort("req-0")  # harmless
        await asyncio.sleep(0.05)
        await engine.close()

    asyncio.run(main())
    assert failing.calls == failing.fail_on_step  # never stepped again after the failure
