"""A routing snapshot with NaN (a step that produced non-finite hidden states) must not
freeze the bits: the pager cleans it before the planner's moving average sees it, so
spare bytes are still spent on raises afterwards (uncleaned, one NaN step kept the
pagedweight policy from ever raising again after pressure, with 2 GB free)."""

import numpy as np

from conftest import build, check_accounting, full_bytes
from pagedweight.memory.pool import KV_USED
from pagedweight.planner.messages import RoutingSnapshot
from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager

KV = 256 << 10


def test_nan_routing_does_not_stop_raises():
    blocks = random_blocks(num_layers=2, num_experts=4, hidden=64, intermediate=96, seed=5)
    full = full_bytes(blocks)
    pool, arena, table, mover = build(blocks, full + 2 * KV)
    planner = InProcessPlanner("pagedweight")
    planner.register(page_table_registration(table.charged_bytes_table(), top_k=2))

    def nan_routing():
        counts = np.ones((2, 4))
        return RoutingSnapshot(counts, np.full((2, 4), np.nan), np.full(2, 4))

    pager = WeightPager(mover, planner, KV, routing=nan_routing)
    kv = [arena.allocate(KV_USED, KV) for _ in range(2)]
    pager.request_bytes(KV)
    pager.step_boundary()
    low = pager.stats().mean_committed_bits
    assert low < 8
    for x in kv:
        arena.free(x)
    assert pager.offer_bytes(pool.free_bytes) > 0  # raises planned despite the NaN window
    for _ in range(20):
        pager.step_boundary()
        mover.wait_for_transits()
        if not pager.busy():
            break
    assert pager.stats().mean_committed_bits > low
    assert pager.num_routing_non_finite >= 2
    check_accounting(pool, arena, table, mover)
    mover.close()
