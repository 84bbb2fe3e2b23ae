"""The engine on a whole worker runtime: KV blocks and expert planes in one arena."""

from __future__ import annotations

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.format.model_config import read_eos_token_ids
from pagedweight.runtime import RuntimeConfig, build_runtime, workspace_bytes

ENGINE = EngineConfig(
    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv=KVCacheConfig(block_size=4)
)
PROMPT_LENS = (5, 30, 12, 21, 3, 17)
MAX_TOKENS = 10


def fixed_budget(paged_dir, bits: int, kv_tokens: int) -> int:
    """Dense weights + workspace + experts at `bits` + room for kv_tokens tokens."""
    from pagedweight.format.paged_model import load_paged_model

    paged = load_paged_model(paged_dir, with_bf16=False)
    c = paged.config
    dense = sum(t.numel() for t in paged.dense_state.values()) * 4
    # charged as the arena charges them: every plane and the LUT in whole pages (format 2's
    # LUT_4, 17 entries a row, rarely fills its last page)
    from pagedweight.format.blocks import lut_bytes, plane_bytes
    from pagedweight.format.paged_model import block_shape
    from pagedweight.memory.arena import DEFAULT_PAGE_BYTES

    def pages(n):
        return -(-n // DEFAULT_PAGE_BYTES) * DEFAULT_PAGE_BYTES

    experts = 0
    for b in paged.block_ids:
        rows, cols = block_shape(c, b.module)
        experts += bits * pages(plane_bytes(rows, cols)) + pages(lut_bytes(rows, bits))
    kv = kv_tokens * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    return dense + workspace_bytes(c, ENGINE, torch.float32) + experts + kv + 8 * 1024


def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def check_pool(runtime):
    snap = runtime.pool.snapshot()
    kv = runtime.engine.kv
    assert snap.reserved_bytes <= snap.budget_bytes
    # a block is num_layers tiles, each charged in whole arena pages
    assert snap.kv_used_bytes == kv.manager.num_used_blocks * kv.charged_block_bytes
    assert snap.kv_free_bytes == kv.manager.num_free_blocks * kv.charged_block_bytes
    live = sum(x.num_pages for x in runtime.arena.live_extents() if x.kind in ("kv_used", "kv_free"))
    assert live * runtime.arena.page_bytes == snap.kv_used_bytes + snap.kv_free_bytes
    assert snap.expert_bytes == runtime.table.resident_expert_bytes()


def run_checked(runtime, requests):
    engine = runtime.engine
    for i, p in enumerate(requests):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert not out.finished or out.finish_reason == "length"
        check_pool(runtime)
    return [outputs[str(i)] for i in range(len(requests))]


def test_static_runtime_equals_generate_and_kv_never_touches_planes(paged_micro_dir):
    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=48)  # too little KV for all at once
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "static-8", engine=ENGINE))
    try:
        got = run_checked(runtime, prompts())
        model = runtime.engine.model
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        assert got == [generate(model, p, params).token_ids for p in prompts()]
        # built without a tokenizer, the engine still has the model's EOS (config files)
        assert runtime.engine.eos_ids >= set(read_eos_token_ids(paged_micro_dir)) > set()
        assert runtime.engine.stats().num_preemptions > 0  # the small KV forced recompute
        for bid, entry in runtime.table.entries.items():  # KV writes left every plane intact
            planes, lut, bits = runtime.table.resident_views(bid)
            host = runtime.table.host[bid]
            assert bits == 8 and all(torch.equal(p, host.planes[i]) for i, p in enumerate(planes))
            assert torch.equal(lut, host.lut(8))
    finally:
        runtime.close()


def test_static_policy_that_cannot_fit_is_a_user_error(paged_micro_dir):
    budget = fixed_budget(paged_micro_dir, 4, kv_tokens=0)
    with pytest.raises(UserError, match="static-8"):
        build_runtime(paged_micro_dir, RuntimeConfig(budget, "static-8", engine=ENGINE))
    with pytest.raises(UserError):
        RuntimeConfig(budget, "static-9")


def test_dynamic_runtime_lowers_bits_under_load_and_raises_them_after(paged_micro_dir):
    """A budget too small for 8-bit experts plus the load's KV: the pager frees bytes for
    KV (bits go down), every request completes without preemption, the pool never goes
    over budget, and once the load has drained the weights take their bytes back."""
    from pagedweight.cli.load_bench import mean_committed_bits

    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=80)  # the load needs ~150 tokens
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    try:
        assert mean_committed_bits(runtime) == 8.0  # memory to spare at rest: highest bits
        engine = runtime.engine
        requests = prompts()
        for i, p in enumerate(requests):
            engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        lowest, outputs = 8.0, {}
        while engine.has_work:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            check_pool(runtime)
            lowest = min(lowest, mean_committed_bits(runtime))
        assert all(len(outputs[str(i)]) == MAX_TOKENS for i in range(len(requests)))
        assert lowest < 8.0 and engine.stats().memory_requests > 0
        assert engine.stats().num_preemptions == 0
        for _ in range(100):  # idle steps: the broker offers the KV bytes back
            engine.step()
            check_pool(runtime)
            if mean_committed_bits(runtime) == 8.0 and not runtime.pager.busy():
                break
            runtime.mover.wait_for_transits()
        assert mean_committed_bits(runtime) == 8.0 and engine.broker.num_offers > 0
        assert engine.kv.num_blocks == 0 and runtime.pool.snapshot().peak_reserved_bytes <= budget
    finally:
        runtime.close()


def test_abort_on_runtime_returns_blocks_to_the_pool_labels(paged_micro_dir):
    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=64)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "static-8", engine=ENGINE))
    try:
        engine = runtime.engine
        for i, p in enumerate(prompts()[:3]):
            engine.add_request(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()
        used = runtime.pool.snapshot().kv_used_bytes
        held = len(engine.seqs["1"].block_ids) * engine.kv.charged_block_bytes
        assert engine.abort("1").finish_reason == "abort"
        assert runtime.pool.snapshot().kv_used_bytes == used - held
        check_pool(runtime)
    finally:
        runtime.close()


def test_a_request_larger_than_kv_at_the_lowest_bits_is_refused(paged_micro_dir):
    from pagedweight.common.errors import ContextLengthError

    budget = fixed_budget(paged_micro_dir, 4, kv_tokens=80)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    try:
        limit = runtime.engine.max_kv_blocks * runtime.engine.kv.block_size
        assert 100 < limit < 2000  # lowering bits to 3 makes room beyond what 4 bits leave
        with pytest.raises(ContextLengthError):
            runtime.engine.add_request("big", [1] * (limit - 5), SamplingParams(max_tokens=10))
        runtime.engine.add_request("fits", [1] * (limit - 10), SamplingParams(max_tokens=10, ignore_eos=True))
        out = runtime.engine.run_to_completion()
        assert len(out["fits"]) == 10
    finally:
        runtime.close()


def test_a_request_whose_kv_can_never_be_had_finishes_unrun_instead_of_hanging(paged_micro_dir):
    """Liveness: the admission check promises more KV than the arena can give (here made to,
    by hand); with nothing running and every block at its floor, the request must finish
    unrun (reason "length", as vLLM ignores such a prompt) and the next one still run."""
    budget = fixed_budget(paged_micro_dir, 4, kv_tokens=80)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    try:
        engine = runtime.engine
        real = engine.max_kv_blocks * engine.kv.block_size
        engine.max_kv_blocks *= 2
        engine.add_request("never", [1] * (real + 40), SamplingParams(max_tokens=4))
        engine.add_request("after", [1] * 16, SamplingParams(max_tokens=4, ignore_eos=True))
        finished, tokens = {}, {"never": [], "after": []}
        for _ in range(500):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            if not engine.has_work:
                break
        assert not engine.has_work, "the engine still waits for KV that cannot come"
        assert finished == {"never": "length", "after": "length"}
        assert tokens["never"] == [] and len(tokens["after"]) == 4
        assert engine.stats().num_finished == 2
    finally:
        runtime.close()


def test_logits_stay_finite_while_the_split_moves(paged_micro_dir):
    """KV pages and expert planes share the arena: a page handed to KV while planes still
    live in it (or the reverse) shows as garbage logits. Under a load that moves the split
    both ways, with sampling (torch.multinomial fails on NaN), every step's logits must be
    finite and every request must complete."""
    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=64)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    engine, non_finite_steps = runtime.engine, []
    sample = engine.runner.sample

    def checked_sample(seqs, logits):
        if not torch.isfinite(logits).all():
            non_finite_steps.append(engine.num_steps)
        return sample(seqs, logits)

    engine.runner.sample = checked_sample
    try:
        gen = torch.Generator().manual_seed(5)
        for i in range(24):
            prompt = torch.randint(1, 4096, (4 + i % 7,), generator=gen).tolist()
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12 + i % 3 * 4, temperature=1.0,
                                                              seed=i, ignore_eos=True))
        finished = set()
        while engine.has_work:
            finished |= {out.request_id for out in engine.step() if out.finished}
            check_pool(runtime)
        assert finished == {str(i) for i in range(24)}
        assert runtime.pager.stats().num_page_moves > 0  # the split did move
        assert non_finite_steps == []
    finally:
        runtime.close()


def test_warm_up_meets_every_bucket_and_drops_its_routing_window(paged_micro_dir):
    """The worker's start-up warm-up: a step of each decode bucket's rows (on the CPU the
    arena's experts keep steps eager; which steps replay graphs is tests/engine's), nothing left in flight, the pool's invariants intact, and the
    routing window those synthetic requests filled discarded so the planner sees live traffic
    only; where every step is eager it does nothing at all."""
    from dataclasses import replace

    from pagedweight.engine.decode_graphs import DecodeGraphs

    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=512)
    eager = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    assert eager.engine.runner.graphs is None and eager.warm_up() == []
    eager.close()

    engine_config = replace(ENGINE, attention_impl="inplace")
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=engine_config))
    engine = runtime.engine
    engine.runner.graphs = DecodeGraphs(engine.model, engine.kv, ENGINE.scheduler.max_num_seqs, capture=False)
    snapshots = runtime.routing_feed.num_snapshots
    buckets = runtime.warm_up()
    assert buckets == list(engine.runner.graphs.buckets) and buckets[-1] == ENGINE.scheduler.max_num_seqs
    assert engine.stats().num_finished == sum(buckets)  # one one-token request per row of each bucket
    assert runtime.routing_feed.num_snapshots > snapshots
    assert not engine.has_work and engine.kv.manager.num_used_blocks == 0
    check_pool(runtime)
    feed = runtime.routing_feed
    assert int(feed.num_tokens.sum()) == 0 and float(feed.counts.sum()) == 0.0
    # live traffic after the warm-up is counted again
    run_checked(runtime, prompts()[:2])
    assert int(feed.num_tokens.sum()) > 0
    runtime.close()


def test_min_kv_tokens_at_start_is_the_kv_room_the_starting_bits_leave(paged_micro_dir):
    """A budget with room for the 8-bit experts and 64 tokens of KV: asked to start with 64
    tokens' room the policy starts at 8 bits; asked for 512 it starts lower, and a room
    larger than the budget can give is a user error naming the tokens."""
    budget = fixed_budget(paged_micro_dir, 8, 64)
    start_bits = {}
    for tokens in (64, 512):
        runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE,
                                                               min_kv_tokens_at_start=tokens))
        try:
            start_bits[tokens] = runtime.pager.stats().mean_committed_bits
        finally:
            runtime.close()
    assert start_bits[64] == 8.0 and start_bits[512] < 8.0
    with pytest.raises(UserError, match="100000 tokens of KV"):
        build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE,
                                                     min_kv_tokens_at_start=100000))


def test_plan_requests_carry_the_engines_inter_token_latency(paged_micro_dir):
    """The engine's moving average of the gaps between sampling steps lies within the gaps the
    caller saw, and the pager's plan requests carry it (the dial's latency target reads it)."""
    import time

    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=80)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, "pagedweight", engine=ENGINE))
    try:
        engine, sent = runtime.engine, []
        submit = runtime.pager.planner.submit
        runtime.pager.planner.submit = lambda request: (sent.append(request), submit(request))[1]
        assert engine.inter_token_s == 0.0
        for i, p in enumerate(prompts()):
            engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        sampled_at = []
        while engine.has_work:
            if any(out.new_token_ids for out in engine.step()):
                sampled_at.append(time.perf_counter())
        gaps = [b - a for a, b in zip(sampled_at, sampled_at[1:])]
        assert min(gaps) * 0.5 <= engine.inter_token_s <= max(gaps) * 1.5
        for _ in range(100):  # idle: the broker offers the KV bytes back, a spend request
            engine.step()
            if len(sent) > 1 and not runtime.pager.busy():
                break
            runtime.mover.wait_for_transits()
        later = [r.inter_token_s for r in sent if r.request_id > 1]
        assert sent and any(x > 0 for x in later) and all(x >= 0 for x in later)
    finally:
        runtime.close()
