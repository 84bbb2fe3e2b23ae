"""The pager's profile counts what really happened: bytes freed by
lowering equal what the boundaries freed, host->device bytes equal the planes and LUTs
the raises and lowerings copied, compaction's device->device bytes equal the extents it
moved, and a block that went down and up shows as a round trip."""

from conftest import build, check_accounting, full_bytes
from pagedweight.memory.pool import KV_USED
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager
from tests.weights.greedy_planner import GreedyPlanner

KV = 256 << 10  # a LUT_8 of these blocks is 96 KiB: a raise needs room for one in flight


def test_profile_matches_the_moves_made():
    blocks = random_blocks(num_layers=2, num_experts=4, hidden=64, intermediate=96, seed=3)
    full = full_bytes(blocks)
    pool, arena, table, mover = build(blocks, full + 2 * KV)
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), KV)
    mover.profile.reset()
    kv = [arena.allocate(KV_USED, KV) for _ in range(2)]
    pager.request_bytes(KV)
    freed = taken = 0
    result = pager.step_boundary()
    freed += result.num_bytes_freed
    lowered = set(result.lowered_ids)
    p = mover.profile
    assert lowered and p.bytes_freed_by_lowering == freed
    # a lowering copies only its new, smaller LUT in
    lut_bytes = sum(table.lut_bytes(b, table.entries[b].committed_bits) for b in lowered)
    assert p.bytes_host_to_device == lut_bytes
    assert p.calls["plan"] == 1 and p.calls["boundary"] == 1
    assert set(p.downs) == lowered and not p.ups
    relocated_before = mover.counters.num_extents_relocated
    moved_bytes = p.bytes_device_to_device
    assert (relocated_before == 0) == (moved_bytes == 0)
    check_accounting(pool, arena, table, mover)

    for x in kv:  # pressure goes: bits come back up
        arena.free(x)
    h2d_before = p.bytes_host_to_device
    for _ in range(20):
        pager.offer_bytes(pool.free_bytes)
        pager.step_boundary()
        mover.wait_for_transits()
        if not pager.busy():
            break
    raised = set(p.ups)
    assert raised and raised <= lowered
    raise_bytes = sum(table.plane_bytes(b) * 1 for b in raised)  # at least one plane each
    assert p.bytes_host_to_device - h2d_before >= raise_bytes
    churn = p.churn()
    assert churn["blocks_lowered_and_raised"] == len(raised) and churn["round_trips"] >= len(raised)
    stats = pager.stats().to_dict()
    assert stats["profile"]["churn"] == churn
    check_accounting(pool, arena, table, mover)
    mover.close()
