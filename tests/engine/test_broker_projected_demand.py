"""The memory broker lowers once for the demand the load will reach, and gives back only
bytes that demand leaves free (no churn)."""

from __future__ import annotations

import dataclasses

from pagedweight.engine.memory_broker import BrokerConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.memory.kv_cache import blocks_for
from pagedweight.runtime import RuntimeConfig, build_runtime
from tests.test_runtime import ENGINE, MAX_TOKENS, check_pool, fixed_budget, prompts


def run_load(paged_dir, project_demand: bool, ask_before_short: bool = True) -> dict:
    broker = BrokerConfig(project_demand=project_demand, ask_before_short=ask_before_short)
    engine_config = dataclasses.replace(ENGINE, broker=broker)
    runtime = build_runtime(paged_dir, RuntimeConfig(fixed_budget(paged_dir, 8, 80), "pagedweight",
                                                     engine=engine_config))
    try:
        engine, requests = runtime.engine, prompts() * 2
        for i, p in enumerate(requests):
            engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        projected_ok, offers_while_queued = True, 0
        while engine.has_work:
            scheduler = engine.scheduler
            admissible = list(scheduler.waiting)[:max(0, ENGINE.scheduler.max_num_seqs - len(scheduler.running))]
            expected = sum(max(0, blocks_for(len(s.prompt_ids) + MAX_TOKENS, 4) - len(s.block_ids))
                           for s in scheduler.running + admissible)
            projected_ok &= scheduler.blocks_projected() == expected
            offers_before = engine.broker.num_offers
            engine.step()
            offers_while_queued += (engine.broker.num_offers > offers_before) and bool(scheduler.waiting)
            check_pool(runtime)
        stats, pager = engine.stats(), runtime.pager.stats()
        return {"projected_ok": projected_ok, "asks": engine.broker.num_requests, "plans": pager.num_plans,
                "short_steps": stats.memory_short_steps, "preemptions": stats.num_preemptions,
                "offers_while_queued": offers_while_queued, "min_bits": pager.mean_committed_bits_min,
                "projected_asks": engine.broker.num_projected_asks}
    finally:
        runtime.close()


def test_projected_demand_lowers_once_and_stalls_less(paged_micro_dir):
    before, after = run_load(paged_micro_dir, False), run_load(paged_micro_dir, True)
    assert after["projected_ok"]
    assert before["min_bits"] < 8.0 and after["min_bits"] < 8.0  # both loads pressed the weights
    assert after["preemptions"] == before["preemptions"] == 0
    assert after["asks"] < before["asks"] and after["plans"] < before["plans"]
    assert after["short_steps"] < before["short_steps"]
    assert after["offers_while_queued"] == 0  # no raise for bytes the queue was about to take


def test_asking_for_the_projection_before_a_shortage_removes_the_stalled_steps(paged_micro_dir):
    """With requests queued, the broker lowers at a step boundary for the projected demand
    the pool cannot hold, before any sequence is short: the load that stalled at its first
    shortage (asking only then) runs without a stalled step, with as few plans and no
    preemption."""
    late, early = run_load(paged_micro_dir, True, ask_before_short=False), run_load(paged_micro_dir, True)
    assert late["short_steps"] > 0 and late["projected_asks"] == 0
    assert early["projected_asks"] > 0 and early["short_steps"] < late["short_steps"]
    assert early["plans"] <= late["plans"] and early["preemptions"] == late["preemptions"] == 0
    assert early["min_bits"] < 8.0 and early["offers_while_queued"] == 0
