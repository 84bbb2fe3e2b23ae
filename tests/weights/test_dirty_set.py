"""An unsettled step boundary visits only the blocks that changed (the
planner's cost stays bounded). The page table keeps a dirty set and the weighted bit sum as bits change;
these tests hold them to a full recomputation and make a scan of the whole table fail."""

from __future__ import annotations

from test_pager_idle import NoScan, settle
from test_weight_pager import make_pager, micro  # noqa: F401 - the fixture



def recomputed_mean(table) -> float:
    entries = table.entries.values()
    return sum(e.committed_bits * e.num_weights for e in entries) / sum(e.num_weights for e in entries)


def test_boundaries_after_a_plan_touch_only_the_blocks_it_changed(micro):  # noqa: F811
    pool, arena, table, mover, pager = make_pager(micro, 0)
    pager.compact_for_kv = False  # compaction walks every extent by design (a separate, capped cost)
    settle(pager)
    ids = list(table.entries)
    changed = {ids[1]: 6, ids[5]: 7}
    table.set_desired_bits(changed)  # from outside the pager: marks them dirty too
    assert {e.block_id for e in table.unsettled()} == set(changed)
    original, table.entries = table.entries, NoScan(table.entries)
    for _ in range(3):  # lower both, settle, and idle again: no boundary iterates the table
        pager.step_boundary()
    table.entries = original
    assert all(table.entries[b].committed_bits == bits for b, bits in changed.items())
    assert table.unsettled() == [] and not pager.busy()
    assert table.mean_committed_bits() == recomputed_mean(table)
    mover.close()


def test_dirty_set_and_mean_follow_every_change(micro):  # noqa: F811
    pool, arena, table, mover, pager = make_pager(micro, 0)
    settle(pager)
    ids = list(table.entries)
    for round_, bits in enumerate((5, 8, 3, 6)):
        plan = {bid: bits for bid in ids[round_::3]}
        table.set_desired_bits(plan)
        table.entries[ids[-1]].desired_bits = 4  # a direct assignment marks the block as well
        off = {e.block_id for e in table.entries.values() if e.desired_bits != e.committed_bits or e.transit_bits}
        assert {e.block_id for e in table.unsettled()} == off
        for _ in range(20):
            pager.step_boundary()
            mover.wait_for_transits()
            if not pager.busy():
                break
        assert not pager.busy() and table.unsettled() == []
        assert all(e.committed_bits == e.desired_bits for e in table.entries.values())
        assert abs(table.mean_committed_bits() - recomputed_mean(table)) < 1e-12
    mover.close()


def test_unsettled_is_computed_once_until_a_block_changes(micro):  # noqa: F811
    """A boundary asks for the unsettled blocks several times (pending sums, raise order, the
    mover, busy): the filtered, sorted list is built once and rebuilt only after a change."""
    pool, arena, table, mover, pager = make_pager(micro, 0)
    settle(pager)
    ids = list(table.entries)
    table.set_desired_bits({ids[4]: 5, ids[2]: 6})
    first = table.unsettled()
    assert [e.block_id for e in first] == [ids[2], ids[4]]  # table order
    assert table.unsettled() is first  # nothing changed: the same list, not a new sort
    table.entries[ids[0]].desired_bits = 7
    second = table.unsettled()
    assert second is not first and [e.block_id for e in second] == [ids[0], ids[2], ids[4]]
    for _ in range(20):
        pager.step_boundary()
        mover.wait_for_transits()
        if not pager.busy():
            break
    assert table.unsettled() == [] and table.dirty == set()
    mover.close()
