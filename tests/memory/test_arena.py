"""The arena: page runs that tile the device tensor exactly and are charged to the pool."""

import random

import pytest
import torch

from pagedweight.memory.arena import Arena, ArenaFragmented
from pagedweight.memory.pool import KV_USED, OTHER_WEIGHTS, TRANSIT, BudgetExceeded, MemoryPool, expert_kind

PAGE = 256


def make_arena(num_pages=64, other=0):
    pool = MemoryPool(num_pages * PAGE + other)
    if other:
        pool.allocate(OTHER_WEIGHTS, other)
    return pool, Arena.from_pool(pool, page_bytes=PAGE)


def test_random_allocations_tile_the_arena_and_match_the_pool():
    pool, arena = make_arena(128, other=1000)
    assert arena.num_pages == 128
    rng = random.Random(0)
    live = []
    for _ in range(2000):
        if live and (rng.random() < 0.45 or arena.num_free_pages == 0):
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            kind = rng.choice([KV_USED, expert_kind(rng.randint(3, 8)), TRANSIT])
            size = rng.randint(1, 5 * PAGE)
            if arena.can_allocate(kind, size):
                live.append(arena.allocate(kind, size))
        assert arena.num_fitting(3 * PAGE) == sum(n // 3 for n in arena._free_len.values())
        arena.check_consistent()
        assert pool.reserved_bytes == arena.used_bytes + 1000 <= pool.budget_bytes
    for x in live:
        arena.free(x)
    assert arena.largest_free_run() == 128 and pool.reserved_bytes == 1000


def test_kv_blocks_come_from_the_top_and_weights_from_the_bottom():
    _, arena = make_arena(16)
    w = arena.allocate(expert_kind(8), 3 * PAGE)
    kv = arena.allocate(KV_USED, 2 * PAGE)
    assert w.first_page == 0 and kv.first_page == 14


def test_fragmentation_is_reported_without_charging_the_pool():
    pool, arena = make_arena(8)
    extents = [arena.allocate(expert_kind(4), PAGE) for _ in range(8)]
    for x in extents[::2]:
        arena.free(x)
    before = pool.reserved_bytes
    assert not arena.can_allocate(KV_USED, 2 * PAGE)
    with pytest.raises(ArenaFragmented):
        arena.allocate(KV_USED, 2 * PAGE)
    assert pool.reserved_bytes == before
    with pytest.raises(BudgetExceeded):
        arena.allocate(KV_USED, 5 * PAGE)


def test_double_free_is_refused():
    _, arena = make_arena(4)
    x = arena.allocate(KV_USED, 10)
    arena.free(x)
    with pytest.raises(ValueError):
        arena.free(x)


def test_views_alias_the_arena_and_block_view_indexes_by_first_page():
    _, arena = make_arena(32)
    arena.allocate(expert_kind(8), 5 * PAGE)  # push the KV blocks off page 0
    shape = (2, 3, 32)  # 192 fp32 = 768 bytes = 3 pages
    blocks = [arena.allocate(KV_USED, 768) for _ in range(4)]
    for i, x in enumerate(blocks):
        arena.view(x, torch.float32, shape).fill_(float(i))
    table = arena.block_view(torch.float32, shape)
    ids = torch.tensor([x.first_page for x in blocks])
    gathered = table[ids]
    for i in range(4):
        assert torch.equal(gathered[i], torch.full(shape, float(i)))
    table[ids[2]] = 7.0  # writes through the strided view land in the block
    assert torch.equal(arena.view(blocks[2], torch.float32, shape), torch.full(shape, 7.0))
    assert torch.equal(arena.view(blocks[1], torch.float32, shape), torch.full(shape, 1.0))


@pytest.mark.parametrize("hole, size", [(1, 5), (3, 2), (2, 2)])
def test_slide_down_moves_an_extent_and_its_bytes_onto_the_hole_below(hole, size):
    """Overlapping or not, the extent's bytes arrive intact, the hole moves above it and
    the pool's charge does not change."""
    pool, arena = make_arena(32)
    first = arena.allocate(expert_kind(3), PAGE)
    gap = arena.allocate(expert_kind(3), hole * PAGE)
    mover = arena.allocate(expert_kind(4), size * PAGE - 7)
    arena.allocate(expert_kind(4), PAGE)  # above: the hole must reappear below this one
    payload = torch.arange(mover.num_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    arena.view(mover, torch.uint8, (mover.num_bytes,)).copy_(payload)
    assert arena.slide_down(first) is None  # page 0: nothing below
    assert arena.slide_down(mover) is None  # the page below is taken
    reserved = pool.reserved_bytes
    arena.free(gap)
    moved = arena.slide_down(mover)
    assert moved.first_page == 1 and (moved.num_pages, moved.num_bytes, moved.kind) == \
        (mover.num_pages, mover.num_bytes, mover.kind)
    assert torch.equal(arena.view(moved, torch.uint8, (moved.num_bytes,)), payload)
    arena.check_consistent()
    top = 2 + hole + size  # first page above the extent that stayed
    assert arena._free_len == {1 + size: hole, top: 32 - top}
    assert pool.reserved_bytes == reserved - hole * PAGE
    with pytest.raises(ValueError):
        arena.slide_down(mover)  # the old extent is gone
