"""The served worker gives the bits back after a load: its engine loop ticks while idle.

The pager raises bits only at calm step boundaries; a worker without requests runs no
steps, so without idle ticks the bits lowered under a load would stay low until the next
load. This drives the worker's own engine loop (AsyncEngine over a pagedweight runtime,
as worker/server.py builds it) and then only waits."""

from __future__ import annotations

import asyncio
import time

from pagedweight.cli.load_bench import mean_committed_bits
from pagedweight.engine.async_engine import AsyncEngine
from pagedweight.engine.sampler import SamplingParams
from pagedweight.runtime import RuntimeConfig, build_runtime
from tests.test_runtime import ENGINE, MAX_TOKENS, fixed_budget, prompts

BITS_BACK_WITHIN_S = 10.0  # how soon bits must return after a burst


async def serve_load_then_wait(engine: AsyncEngine, runtime) -> tuple[float, float]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def consume(stream):
        async for _ in stream:
            pass

    await asyncio.gather(*(consume(engine.add_request(p, params)) for p in prompts()))
    lowest = runtime.pager.stats().mean_committed_bits_min
    ended = time.monotonic()
    while time.monotonic() - ended < BITS_BACK_WITHIN_S:
        if mean_committed_bits(runtime) == 8.0 and not runtime.pager.busy():
            break
        await asyncio.sleep(0.02)  # nothing but the loop's idle ticks runs the engine
    return lowest, time.monotonic() - ended


def test_bits_return_after_a_load_ends_without_further_requests(paged_micro_dir):
    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=80)  # the load needs ~150 tokens of KV
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    engine = AsyncEngine(runtime.engine, idle_tick_s=0.01)
    try:
        lowest, waited = asyncio.run(serve_load_then_wait(engine, runtime))
        assert lowest < 8.0  # the load really pressed the weights
        assert mean_committed_bits(runtime) == 8.0, f"bits still {mean_committed_bits(runtime)} after {waited:.1f} s"
        assert waited < BITS_BACK_WITHIN_S and engine.num_idle_ticks > 0
        assert runtime.engine.stats().num_preemptions == 0
        # converged: the loop stops ticking (it would otherwise spin for ever between loads)
        assert not runtime.engine.broker.wants_idle_steps()
    finally:
        asyncio.run(engine.close())
        runtime.close()
