"""Compaction's scan (page_mover.compact): it caches the lowest fit per extent size between
moves and asks `done()` only after a move, so these pin what that must not change."""

import torch

from conftest import build, check_accounting, static_weight
from test_page_mover import BUDGET, weights_from_arena


def lowered(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET)
    table.set_desired_bits({bid: 3 for bid in table.entries})
    mover.step_boundary()
    return pool, arena, table, mover


def weight_extents(table):
    return [x for e in table.entries.values() for x in e.plane_extents + [e.lut_extent]]


def test_after_a_full_compaction_no_weight_extent_could_move_lower(small_blocks):
    pool, arena, table, mover = lowered(small_blocks)
    assert mover.compact() > 0
    for x in weight_extents(table):
        fit = arena.lowest_fit(x.num_pages)
        assert fit is None or fit > x.first_page, x
    for bid, w in weights_from_arena(table).items():
        assert torch.equal(w, static_weight(table, bid, 3))
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_compaction_stops_right_after_the_move_that_makes_done_true(small_blocks):
    pool, arena, table, mover = lowered(small_blocks)
    base = sum(e.version for e in table.entries.values())  # one version bump per relocated extent
    calls = []

    def done():
        calls.append(1)
        return sum(e.version for e in table.entries.values()) - base >= 3

    assert mover.compact(done) == 3
    assert len(calls) == 4  # once before the scan, once after each move
    assert mover.compact(lambda: True) == 0  # done before anything: nothing moves
    check_accounting(pool, arena, table, mover)
    mover.close()
