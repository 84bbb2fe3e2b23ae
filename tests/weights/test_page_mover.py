"""The page mover's invariants: committed bits are what readers see, in-flight pages are
never read, bytes freed and taken are exactly the plane and LUT pages."""

import threading

import torch

from conftest import build, check_accounting, static_weight
from pagedweight.memory.pool import KV_USED
from pagedweight.weights.arena_experts import ArenaExperts
from pagedweight.weights.page_table import Residency

BUDGET = 1 << 20


def weights_from_arena(table):
    experts = ArenaExperts(table, 0, 0, cache_dequantized=False)
    return {bid: experts.weight(bid, torch.float32) for bid in table.entries}


def test_load_puts_every_block_at_its_bits(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET, initial_bits=6)
    for bid, w in weights_from_arena(table).items():
        assert table.entries[bid].state is Residency.RESIDENT
        assert torch.equal(w, static_weight(table, bid, 6))
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_lowering_frees_exactly_the_dropped_pages_and_reads_the_new_lut(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET)
    plan = {bid: 3 + i % 5 for i, bid in enumerate(table.entries)}
    before = pool.reserved_bytes
    table.set_desired_bits(plan)
    result = mover.step_boundary()
    freed = sum(table.charged_bytes(bid, 8) - table.charged_bytes(bid, b) for bid, b in plan.items())
    assert result.num_bytes_freed - result.num_bytes_taken == freed == before - pool.reserved_bytes
    assert sorted(result.lowered_ids) == sorted(b for b, bits in plan.items() if bits < 8)
    for bid, w in weights_from_arena(table).items():
        assert table.entries[bid].committed_bits == plan[bid]
        assert torch.equal(w, static_weight(table, bid, plan[bid]))
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_a_raise_in_flight_is_never_read_and_commits_only_at_a_boundary(small_blocks):
    release = threading.Event()
    release.set()  # load_all needs its copies; hold the ones after it
    pool, arena, table, mover = build(small_blocks, BUDGET, initial_bits=4, before_copy=release.wait)
    release.clear()
    table.set_desired_bits({bid: 7 for bid in table.entries})
    started = mover.step_boundary()
    assert len(started.started_ids) == len(table.entries)
    transit = {(x.first_page, x.num_pages) for x in mover.in_transit_extents()}
    assert transit and all(e.state is Residency.IN_TRANSIT for e in table.entries.values())
    check_accounting(pool, arena, table, mover)

    table.read_log = []
    for _ in range(3):  # steps while the copies are held: still the 4-bit weights
        for bid, w in weights_from_arena(table).items():
            assert torch.equal(w, static_weight(table, bid, 4))
        assert mover.step_boundary().committed_ids == []
    assert not transit & {(x.first_page, x.num_pages) for x in table.read_log}

    release.set()
    mover.wait_for_transits()
    for bid, w in weights_from_arena(table).items():  # landed, but not committed yet
        assert torch.equal(w, static_weight(table, bid, 4))
    result = mover.step_boundary()
    assert len(result.committed_ids) == len(table.entries)
    for bid, w in weights_from_arena(table).items():
        assert torch.equal(w, static_weight(table, bid, 7))
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_lowering_a_block_in_transit_waits_for_its_copy(small_blocks):
    release = threading.Event()
    release.set()
    pool, arena, table, mover = build(small_blocks, BUDGET, initial_bits=4, before_copy=release.wait)
    release.clear()
    bid = next(iter(table.entries))
    table.set_desired_bits({bid: 8})
    mover.step_boundary()
    table.set_desired_bits({bid: 3})
    assert mover.step_boundary().lowered_ids == []  # copy still held
    release.set()
    mover.wait_for_transits()
    result = mover.step_boundary()
    assert result.committed_ids == [bid] and result.lowered_ids == [bid]
    assert table.entries[bid].committed_bits == 3 and not mover.busy()
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_a_raise_waits_when_the_arena_is_full(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET, initial_bits=3)
    bytes_at_3 = sum(table.charged_bytes(bid, 3) for bid in table.entries)
    filler = arena.allocate(KV_USED, arena.num_free_pages * arena.page_bytes)
    table.set_desired_bits({bid: 5 for bid in table.entries})
    assert mover.step_boundary().started_ids == []
    assert pool.snapshot().expert_bytes == bytes_at_3 and mover.busy()
    arena.free(filler)
    assert len(mover.step_boundary().started_ids) == len(table.entries)
    mover.wait_for_transits()
    mover.step_boundary()
    assert not mover.busy()
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_compaction_moves_weights_down_and_keeps_their_values(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET)
    table.set_desired_bits({bid: 3 for bid in table.entries})
    mover.step_boundary()
    assert arena.largest_free_run() < arena.num_free_pages  # holes where planes were
    versions = {bid: e.version for bid, e in table.entries.items()}
    moved = mover.compact()
    assert moved > 0
    # First-fit compaction leaves only holes no extent fits in (format 2's LUT sizes are not
    # multiples of a plane's pages): every hole below the highest extent is smaller than the
    # smallest extent, and the free space above it is one run
    live = sorted((x.first_page, x.num_pages) for x in arena.live_extents())
    smallest = min(n for _, n in live)
    holes = [b - (a + n) for (a, n), (b, _) in zip(live, live[1:]) if b > a + n]
    assert all(h < smallest for h in holes)
    assert arena.largest_free_run() == arena.num_free_pages - sum(holes) > sum(holes)
    assert mover.compact() == 0  # nothing left to move down
    assert any(e.version != versions[bid] for bid, e in table.entries.items())
    for bid, w in weights_from_arena(table).items():
        assert torch.equal(w, static_weight(table, bid, 3))
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_a_raise_goes_part_of_the_way_when_only_that_fits(small_blocks):
    pool, arena, table, mover = build(small_blocks, BUDGET, initial_bits=3)
    bid = next(iter(table.entries))
    room = mover._transit_bytes(bid, 3, 5)
    filler = arena.allocate(KV_USED, arena.num_free_pages * arena.page_bytes - room)
    table.set_desired_bits({bid: 8})
    assert mover.step_boundary().started_ids == [bid] and table.entries[bid].transit_bits == 5
    check_accounting(pool, arena, table, mover)
    mover.wait_for_transits()
    assert mover.step_boundary().committed_ids == [bid]
    assert table.entries[bid].committed_bits == 5 and mover.busy()
    arena.free(filler)
    mover.step_boundary()
    mover.wait_for_transits()
    mover.step_boundary()
    assert table.entries[bid].committed_bits == 8 and not mover.busy()
    assert torch.equal(weights_from_arena(table)[bid], static_weight(table, bid, 8))
    mover.close()


def test_table_generation_counts_every_version_bump(small_blocks):
    """Readers that cache descriptors (ArenaExperts.kernel_layer, graph_state) skip their
    walk over the blocks while the table's generation stands still: it must move with
    every lowering, raise and relocation, and only then."""
    pool, arena, table, mover = build(small_blocks, BUDGET)

    def bumps():
        return sum(e.version for e in table.entries.values())

    start = table.generation - bumps()
    mover.step_boundary()  # nothing to do
    assert table.generation - bumps() == start
    table.set_desired_bits({bid: 3 for bid in table.entries})
    before = table.generation
    mover.step_boundary()  # lowerings
    assert table.generation > before and table.generation - bumps() == start
    before = table.generation
    assert mover.compact() > 0  # relocations
    assert table.generation > before and table.generation - bumps() == start
    table.set_desired_bits({bid: 5 for bid in table.entries})
    mover.step_boundary()
    mover.wait_for_transits()
    before = table.generation
    mover.step_boundary()  # raises commit
    assert table.generation > before and table.generation - bumps() == start
    mover.close()


def test_a_raise_waits_for_bytes_in_flight_rather_than_landing_in_pieces(small_blocks):
    """Bytes for one whole raise and part of a second: the second waits for the first to
    commit (its old LUT freed) and then goes whole: two commits, not three (before, it went
    part of the way at once and finished at a later boundary). With nothing in flight a
    raise still goes part of the way (test_budget_range)."""
    _, _, probe_table, probe = build(small_blocks, BUDGET, initial_bits=4)
    used = probe.arena.pool.reserved_bytes
    # down blocks (64 x 96): their planes outweigh LUT_4 enough that B can go part of the way
    # beside A (gate_up's 64 columns make LUT_4 larger than a 4 -> 5 raise's room)
    a, b = [bid for bid in probe_table.entries if bid.module == "down"][:2]
    whole_a, whole_b = probe._transit_bytes(a, 4, 8), probe._transit_bytes(b, 4, 8)
    old_lut_a = probe.arena.charged_bytes(probe_table.lut_bytes(a, 4))
    probe.close()
    free = whole_a + whole_b - old_lut_a  # B whole fits only once A's LUT_4 is freed
    pool, arena, table, mover = build(small_blocks, used + free, initial_bits=4)
    assert pool.free_bytes == free and mover._transit_bytes(b, 4, 5) <= free - whole_a < whole_b
    loaded = mover.counters.num_raises_committed
    table.set_desired_bits({a: 8, b: 8})
    first = mover.step_boundary([a, b])
    assert first.started_ids == [a] and table.entries[b].transit_bits == 0
    mover.wait_for_transits()
    second = mover.step_boundary([a, b])
    assert second.committed_ids == [a] and second.started_ids == [b] and table.entries[b].transit_bits == 8
    mover.wait_for_transits()
    assert mover.step_boundary([a, b]).committed_ids == [b]
    assert mover.counters.num_raises_committed - loaded == 2 and not mover.busy()
    for bid, w in weights_from_arena(table).items():
        assert torch.equal(w, static_weight(table, bid, 8 if bid in (a, b) else 4))
    check_accounting(pool, arena, table, mover)
    mover.close()
