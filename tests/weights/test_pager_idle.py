"""An idle step boundary does no work per expert block (O(1) when nothing moves).

At 12k+ blocks a scan of the page table at every step would cost milliseconds; the pager
keeps a `settled` flag instead. These tests make any touch of the table's entries raise
once the pager has settled, so a scan creeping back into the idle path fails here."""

from test_weight_pager import make_pager, micro  # noqa: F401 - the fixture


class NoScan(dict):
    """The page table's entries, refusing to be iterated (lookups of one block still work)."""

    def _refuse(self, *args):
        raise AssertionError("an idle step boundary scanned the page table")

    __iter__ = values = items = keys = _refuse


def settle(pager):
    for _ in range(4):
        pager.step_boundary()
    assert not pager.busy()


def test_idle_step_boundaries_never_scan_the_blocks(micro):  # noqa: F811
    pool, arena, table, mover, pager = make_pager(micro, 0)
    settle(pager)
    original, table.entries = table.entries, NoScan(table.entries)
    for _ in range(100):
        assert pager.step_boundary().lowered_ids == []
    table.entries = original
    mover.close()


def test_a_refused_offer_repeated_on_calm_steps_never_scans_the_blocks(micro):  # noqa: F811
    pool, arena, table, mover, pager = make_pager(micro, 0)
    settle(pager)
    pager.offer_bytes(pool.free_bytes)  # nothing spare to spend on: refused and remembered
    settle(pager)
    original, table.entries = table.entries, NoScan(table.entries)
    for _ in range(10):
        assert pager.offer_bytes(pool.free_bytes) == 0
        pager.step_boundary()
    table.entries = original
    mover.close()
