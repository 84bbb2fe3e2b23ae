"""Compaction for raises waits for a boundary with no sequence running when the pager is
told so (`compact_raises_while_running=False`, the runtime's setting): with sequences
running, a raise that no free run holds starts no compaction (each one copies on
the compute stream and walks every extent on the host); the default pager compacts at once
in the same situation (so the test can fail). Once the load has gone the raises land
either way, and every byte stays accounted throughout."""

import pytest

from conftest import build, check_accounting, full_bytes
from pagedweight.memory.pool import KV_USED
from tests.weights.greedy_planner import GreedyPlanner
from pagedweight.weights.weight_pager import WeightPager


def fragmented(small_blocks, while_running: bool):
    """Every block lowered to 3 bits, the holes filled with one-page KV extents and every
    other one freed: bytes enough for raises, but no free run longer than a page."""
    pool, arena, table, mover = build(small_blocks, full_bytes(small_blocks))
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()),
                        compact_raises_while_running=while_running)
    table.set_desired_bits({bid: 3 for bid in table.entries})
    pager.step_boundary()
    kv = []
    while arena.can_allocate(KV_USED, arena.page_bytes):
        kv.append(arena.allocate(KV_USED, arena.page_bytes))
    for x in kv[::2]:
        arena.free(x)
    assert arena.largest_free_run() == 1 and pool.free_bytes > 0
    assert pager.offer_bytes(pool.free_bytes) > 0  # raises planned
    return pool, arena, table, mover, pager, kv[1::2]


@pytest.mark.parametrize("while_running", [True, False])
def test_raises_compact_only_once_no_sequence_runs(small_blocks, while_running):
    pool, arena, table, mover, pager, kv = fragmented(small_blocks, while_running)
    compactions = lambda: mover.profile.to_dict()["calls"].get("compact_for_raise", 0)
    result = pager.step_boundary(sequences_running=True)
    assert result.num_raises_fragmented > 0
    if while_running:  # compaction inside the load
        assert compactions() == 1 and pager.num_compactions_deferred == 0
    else:
        assert compactions() == 0 and pager.num_compactions_deferred == 1
    check_accounting(pool, arena, table, mover)
    # the load ends: its KV goes back, nothing runs, an offer plans the raises again
    for x in kv:
        arena.free(x)
    for _ in range(200):
        pager.offer_bytes(pool.free_bytes)
        pager.step_boundary(sequences_running=False)
        mover.wait_for_transits()
        check_accounting(pool, arena, table, mover)
        if not pager.busy() and pager.offer_bytes(pool.free_bytes) == 0:
            break
    # A budget of exactly every block at 8 bits: the last raise cannot hold LUT_8 beside its
    # old LUT in flight, so all but that one come back
    assert sum(e.committed_bits == 8 for e in table.entries.values()) >= len(table.entries) - 1
    mover.close()
