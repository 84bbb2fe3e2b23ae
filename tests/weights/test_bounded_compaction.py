"""Compaction is bounded per step boundary: a boundary copies at most
`compact_bytes_per_boundary` (plus the one extent that crosses it), and a capped
compaction goes on at the next boundaries until the KV target fits, every byte
accounted at each one."""

import pytest
import torch

from conftest import build, check_accounting
from pagedweight.memory.pool import KV_USED
from pagedweight.model.loader import load_model
from pagedweight.weights.synthetic import blocks_from_model
from pagedweight.weights.weight_pager import WeightPager
from tests.weights.greedy_planner import GreedyPlanner



@pytest.mark.parametrize("cap_by", ["bytes", "extents"])
def test_capped_compaction_continues_across_boundaries(bundled_model_dir, cap_by):
    """cap_by "extents": no byte cap, at most 3 extents moved per boundary (host work bounded
    where many small extents fit under any byte cap)."""
    blocks = blocks_from_model(load_model(bundled_model_dir, dtype=torch.float32))
    probe = build(blocks, 64 << 20)
    full = probe[0].reserved_bytes
    probe[3].close()
    largest = max(x.num_bytes for e in probe[2].entries.values() for x in e.plane_extents + [e.lut_extent])
    BIG_KV = 4 * largest  # larger than any hole one lowering leaves: lowering alone cannot make room
    pool, arena, table, mover = build(blocks, full + 3 * BIG_KV)
    mover.profile.reset()
    cap, max_moves = (2 * largest, None) if cap_by == "bytes" else (None, 3)
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), BIG_KV, compact_bytes_per_boundary=cap,
                        compact_extents_per_boundary=max_moves)
    kv = [arena.allocate(KV_USED, BIG_KV) for _ in range(3)]
    pager.request_bytes(20 * BIG_KV)
    p = mover.profile
    per_boundary, moves, capped = [], [], 0
    for _ in range(400):
        before, moved_before = p.bytes_device_to_device, mover.counters.num_extents_relocated
        pager.step_boundary()
        per_boundary.append(p.bytes_device_to_device - before)
        moves.append(mover.counters.num_extents_relocated - moved_before)
        check_accounting(pool, arena, table, mover)
        if not pager._compaction_left and per_boundary[-1] == 0:
            break
    capped = p.num_compaction_capped
    # as much as an unbounded compaction makes usable: the bytes asked for, or every free byte
    usable = min(20, arena.num_free_pages // arena.pages_for(BIG_KV))
    assert usable >= 5 and arena.num_fitting(BIG_KV) >= usable, (per_boundary, arena.num_fitting(BIG_KV))
    assert capped >= 2 and len([n for n in per_boundary if n]) >= 3  # it really took several boundaries
    if cap_by == "bytes":
        assert max(per_boundary) < cap + largest
    else:
        assert max(moves) == max_moves
    kv += [arena.allocate(KV_USED, BIG_KV) for _ in range(usable)]
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_without_compaction_for_kv_lowering_moves_no_weight_and_its_holes_hold_tiles(bundled_model_dir):
    """compact_for_kv=False (the runtime's setting with per-layer KV tiles): a lowering
    relocates nothing, and the holes it leaves hold KV tiles no larger than a plane."""
    blocks = blocks_from_model(load_model(bundled_model_dir, dtype=torch.float32))
    probe = build(blocks, 64 << 20)
    full = probe[0].reserved_bytes
    plane = min(probe[2].plane_bytes(b) for b in probe[2].entries)
    probe[3].close()
    pool, arena, table, mover = build(blocks, full)
    tile = arena.charged_bytes(plane) // 2  # a KV unit smaller than any plane's hole
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), tile, compact_for_kv=False)
    mover.profile.reset()
    assert not arena.can_allocate(KV_USED, tile)
    pager.request_bytes(40 * tile)
    result = pager.step_boundary()
    assert result.lowered_ids
    assert mover.counters.num_extents_relocated == 0 and mover.profile.bytes_device_to_device == 0
    fitting = arena.num_fitting(tile)
    assert fitting >= 2 * len(result.lowered_ids)  # every dropped plane's hole holds two tiles at least
    kv = [arena.allocate(KV_USED, tile) for _ in range(fitting)]
    assert len(kv) == fitting
    check_accounting(pool, arena, table, mover)
    mover.close()
