"""The KV block manager and the chunked KV cache: exact block accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.memory.arena import Arena
from pagedweight.memory.kv_cache import KV_FREE, KV_USED, KVBlockManager, KVCacheConfig, PagedKVCache
from pagedweight.memory.pool import OTHER_WEIGHTS, MemoryPool
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.paged_attention import SeqSlice, build_step, paged_attention
from tests.conftest import BUNDLED_MODEL


@dataclass
class Seq:
    seq_id: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


def check_accounting(manager: KVBlockManager, seqs: list[Seq]) -> None:
    tables = [b for s in seqs for b in s.block_ids]
    assert len(tables) == len(set(tables)), "a block is in two tables"
    assert manager.num_used_blocks == len(tables)
    assert manager.num_used_blocks + manager.num_free_blocks == manager.num_blocks
    assert manager.owned_block_ids() == {b: s.seq_id for s in seqs for b in s.block_ids}
    for s in seqs:
        assert len(s.block_ids) == -(-s.num_tokens // manager.block_size)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 20)), max_size=40))
def test_random_allocate_free_keeps_exact_accounting(ops):
    manager = KVBlockManager(block_size=4)
    manager.add_blocks(range(0, 12))
    seqs = [Seq(i) for i in range(5)]
    for seq_idx, op, n in ops:
        seq = seqs[seq_idx]
        if op == 2:
            manager.free(seq)
            seq.num_tokens = 0
        elif manager.can_allocate(seq, seq.num_tokens + n):
            manager.allocate(seq, seq.num_tokens + n)
            seq.num_tokens += n
        else:
            with pytest.raises(RuntimeError):
                manager.allocate(seq, seq.num_tokens + n)
        check_accounting(manager, seqs)
    for seq in seqs:
        manager.free(seq)
    assert manager.num_free_blocks == 12 and manager.num_used_blocks == 0


def test_lowest_blocks_first_so_a_fixed_cache_stays_compact():
    manager = KVBlockManager(block_size=2)
    manager.add_blocks(range(0, 8))
    a, b = Seq(0), Seq(1)
    manager.allocate(a, 5)
    manager.allocate(b, 3)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    manager.free(a)
    manager.allocate(b, 8)
    assert b.block_ids == [3, 4, 0, 1]


def make_arena(num_kv_blocks: float, block_bytes: int, reserved: int = 0):
    pool = MemoryPool(budget_bytes=reserved + int(num_kv_blocks * block_bytes) + 1000)
    if reserved:
        pool.allocate(OTHER_WEIGHTS, reserved)
    return pool, Arena.from_pool(pool, page_bytes=1024)


def test_arena_cache_grows_shrinks_and_labels_bytes_exactly():
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    probe = PagedKVCache(config, KVCacheConfig(block_size=4), torch.float32, "cpu")
    pool, arena = make_arena(5.5, probe.block_bytes)
    kv = PagedKVCache(config, KVCacheConfig(block_size=4), torch.float32, "cpu", arena=arena)
    assert kv.num_blocks == 0
    assert kv.grow(100) == 5 and kv.num_blocks == 5  # the budget holds five blocks
    assert pool.bytes_of(KV_FREE) == 5 * kv.block_bytes and pool.bytes_of(KV_USED) == 0
    a, b = Seq(0), Seq(1)
    kv.allocate(a, 9)  # three blocks, those placed highest first
    kv.allocate(b, 1)
    low = {bid: min(x.first_page for x in kv._tiles[bid]) for bid in a.block_ids + b.block_ids}
    placed = [low[bid] for bid in a.block_ids]
    assert placed == sorted(placed, reverse=True) and min(placed) > low[b.block_ids[0]]
    assert pool.bytes_of(KV_USED) == 4 * kv.block_bytes == kv.used_bytes
    assert pool.bytes_of(KV_FREE) == 1 * kv.block_bytes
    assert kv.shrink() == kv.block_bytes and kv.num_blocks == 4
    kv.free(a)
    assert pool.bytes_of(KV_USED) == kv.block_bytes and pool.bytes_of(KV_FREE) == 3 * kv.block_bytes
    assert kv.shrink(keep_free_blocks=1) == 2 * kv.block_bytes
    assert kv.num_blocks == 2 and kv.manager.num_free_blocks == 1
    arena.check_consistent()
    kv.free(b)
    kv.shrink()
    assert kv.num_blocks == 0 and pool.reserved_bytes == 0 and arena.num_free_pages == arena.num_pages


@pytest.mark.parametrize("use_arena", [False, True])
def test_tokens_read_back_through_block_tables(use_arena):
    """Tokens written through one table read back the same, by token and by block."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv_config = KVCacheConfig(block_size=2)
    if use_arena:
        probe = PagedKVCache(config, kv_config, torch.float32, "cpu")
        _, arena = make_arena(8, probe.block_bytes, reserved=3000)
        kv = PagedKVCache(config, kv_config, torch.float32, "cpu", arena=arena)
        kv.grow(8)
    else:
        kv = PagedKVCache(config, kv_config, torch.float32, "cpu", num_blocks=8)
    ids = sorted(kv.manager.take_free_blocks(8))
    kv.manager.add_blocks(ids)
    tables = [[ids[5], ids[0], ids[3]], [ids[1], ids[6]]]
    step = build_step(kv, [SeqSlice(tables[0], 6, 6), SeqSlice(tables[1], 3, 3)], "reference")
    G, D = config.num_kv_heads, config.head_dim
    k, v = torch.randn(9, G, D), torch.randn(9, G, D)
    paged_attention(1, torch.randn(9, config.num_heads, D), k, v, step)
    keys, values = kv.read_tokens(1, step.context_offsets)
    assert torch.equal(keys, k) and torch.equal(values, v)
    bk, bv = kv.read_blocks(1, torch.tensor(tables[0]))  # [3, 2, G, D]
    assert torch.equal(bk.reshape(6, G, D), k[:6]) and torch.equal(bv.reshape(6, G, D), v[:6])
    other, _ = kv.read_blocks(0, torch.tensor(tables[0]))
    assert not torch.equal(other.reshape(6, G, D), k[:6])  # layer 0 was not written


def test_release_before_gives_back_only_blocks_wholly_behind_the_window():
    from pagedweight.memory.kv_cache import RELEASED

    manager = KVBlockManager(block_size=4)
    manager.add_blocks(range(8))
    seq, other = Seq(1), Seq(2)
    manager.allocate(seq, 14)  # blocks 0..3 hold positions 0..13
    manager.allocate(other, 3)
    assert manager.release_before(seq, 7) == [0]  # block 1 still holds position 7
    assert manager.release_before(seq, 7) == []  # idempotent
    assert manager.release_before(seq, 12) == [1, 2]
    assert seq.block_ids == [RELEASED, RELEASED, RELEASED, 3]  # positions keep their index
    assert manager.num_used_blocks == 2 and manager.num_free_blocks == 6
    manager.allocate(seq, 17)  # the table grows past its released entries
    assert len(seq.block_ids) == 5 and seq.block_ids[:3] == [RELEASED] * 3
    live = [3, seq.block_ids[4]]
    assert sorted(manager.free(seq)) == sorted(live)
    assert manager.num_used_blocks == 1 and manager.num_free_blocks == 7
    other.block_ids.append(5)  # a block it does not own
    with pytest.raises(RuntimeError, match="not owned"):
        manager.release_before(other, 8)


def _cache_in_small_arena(device: str):
    """The bundled model's config, an arena of 1 KiB pages with room for about 40 blocks, a KV cache in it."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv_config = KVCacheConfig(block_size=2)
    probe = PagedKVCache(config, kv_config, torch.float32, "cpu")
    pool = MemoryPool(budget_bytes=40 * probe.block_bytes + 1000)
    arena = Arena.from_pool(pool, page_bytes=1024, device=device)
    return config, arena, PagedKVCache(config, kv_config, torch.float32, device, arena=arena)


def _fragmented_tile_cache(seed: int, device: str = "cpu"):
    """An arena cache whose tiles are scattered: weights-like extents are allocated between
    growths and some freed, so blocks' tiles land in holes, not side by side."""
    config, arena, kv = _cache_in_small_arena(device)
    gen = torch.Generator().manual_seed(seed)
    fillers = [arena.allocate(OTHER_WEIGHTS, int(torch.randint(1, 3, (), generator=gen)) * kv.tile_bytes)
               for _ in range(30)]
    for x in fillers[::3]:  # holes among the "weights"
        arena.free(x)
    grown = kv.grow(8)
    assert grown == 8
    arena.check_consistent()
    return config, kv


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("use_arena", [False, True])
def test_kv_tile_offsets_address_the_tiles_read_blocks_returns(use_arena, device):
    """The contract with the paged decode kernel: for random block tables,
    flat[k_off : k_off + tile] and flat[v_off : v_off + tile] are the blocks' K and V
    tiles of that layer, under the per-layer tile layout (tiles of one block anywhere)."""
    if use_arena:
        config, kv = _fragmented_tile_cache(0, device)
        tiles = {b: [x.first_page for x in kv._tiles[b]] for b in kv._tiles}
        assert any(sorted(p) != list(range(p[0], p[0] + len(p) * (p[1] - p[0]), p[1] - p[0]))
                   or p[1] - p[0] != kv.arena.pages_for(kv.tile_bytes) for p in tiles.values()), tiles
    else:
        config = ModelConfig.from_dir(BUNDLED_MODEL)
        kv = PagedKVCache(config, KVCacheConfig(block_size=2), torch.float32, device, num_blocks=8)
    kv.flat.copy_(torch.randn(kv.flat.shape))  # every tile distinct
    ids = sorted(kv.manager.take_free_blocks(8))
    kv.manager.add_blocks(ids)
    gen = torch.Generator().manual_seed(1)
    tile = kv.block_size * kv.num_kv_heads * kv.head_dim
    for layer in range(config.num_layers):
        table = torch.tensor(ids)[torch.randint(0, len(ids), (3, 5), generator=gen)].to(device)
        table[0, -1] = -1  # a released / padding entry reads block 0's place, never raises
        k_off, v_off = kv.kv_tile_offsets(layer, table)
        assert k_off.shape == v_off.shape == table.shape
        k, v = kv.read_blocks(layer, table[1:].reshape(-1))
        for i, (ko, vo) in enumerate(zip(k_off[1:].reshape(-1).tolist(), v_off[1:].reshape(-1).tolist())):
            assert torch.equal(kv.flat[ko:ko + tile].view(k[i].shape), k[i])
            assert torch.equal(kv.flat[vo:vo + tile].view(v[i].shape), v[i])


def _scattered_cache(use_arena: bool, device):
    """(config, cache, its 8 block ids): tiles scattered through a fragmented arena, or the
    fixed cache's layout."""
    if use_arena:
        config, kv = _fragmented_tile_cache(0, device)
    else:
        config = ModelConfig.from_dir(BUNDLED_MODEL)
        kv = PagedKVCache(config, KVCacheConfig(block_size=2), torch.float32, device, num_blocks=8)
    ids = sorted(kv.manager.take_free_blocks(8))
    kv.manager.add_blocks(ids)
    return config, kv, ids


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("use_arena", [False, True])
def test_per_step_indices_equal_the_per_layer_ones(use_arena, device):
    """The once-per-step index work: `write_rows` through `token_rows` leaves
    the cache exactly as `write` does, and `kv_tile_offsets_all` is `kv_tile_offsets` of
    every layer, on scattered tiles and random slots."""
    config, kv, ids = _scattered_cache(use_arena, device)
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([b * kv.block_size + o for b in ids for o in range(kv.block_size)])
    slots = slots[torch.randperm(len(slots), generator=gen)[:5]].to(device)  # distinct slots
    table = torch.tensor(ids)[torch.randint(0, len(ids), (3, 4), generator=gen)].to(device)
    table[1, -1] = -1
    rows = kv.token_rows(slots)
    assert rows is not None and rows.shape == (config.num_layers, 2, len(slots))
    offsets_all = kv.kv_tile_offsets_all(table)
    start = torch.randn(kv.flat.shape, generator=gen).to(device)
    by_write, by_rows = start.clone(), start.clone()
    for layer in range(config.num_layers):
        k, v = (torch.randn(len(slots), kv.num_kv_heads, kv.head_dim, generator=gen).to(device) for _ in "kv")
        kv.flat.copy_(by_write)
        kv.write(layer, slots, k, v)
        by_write.copy_(kv.flat)
        kv.flat.copy_(by_rows)
        kv.write_rows(layer, rows, k, v)
        by_rows.copy_(kv.flat)
        assert torch.equal(by_rows, by_write) and not torch.equal(by_rows, start)
        for got, want in zip((t[layer] for t in offsets_all), kv.kv_tile_offsets(layer, table)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("use_arena", [False, True])
def test_token_elements_start_the_rows_write_fills(use_arena, device):
    """`token_elements` (where decode_ops.rope_write puts each new token's K and V):
    under either layout, the G * D elements from each start are exactly the ones `write`
    changes, in token order, and where whole token rows exist they are `token_rows` x G * D."""
    config, kv, ids = _scattered_cache(use_arena, device)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([b * kv.block_size + o for b in ids for o in range(kv.block_size)])
    slots = slots[torch.randperm(len(slots), generator=gen)[:5]].to(device)
    starts = kv.token_elements(slots)
    per_token = kv.num_kv_heads * kv.head_dim
    assert starts.shape == (config.num_layers, 2, len(slots))
    within = torch.arange(per_token, device=device)
    for layer in range(config.num_layers):
        k, v = (torch.randn(len(slots), kv.num_kv_heads, kv.head_dim, generator=gen).to(device) for _ in "kv")
        kv.flat.zero_()
        kv.write(layer, slots, k, v)
        assert torch.equal(kv.flat[starts[layer, 0][:, None] + within], k.reshape(len(slots), -1))
        assert torch.equal(kv.flat[starts[layer, 1][:, None] + within], v.reshape(len(slots), -1))
        assert int((kv.flat != 0).sum()) == (k != 0).sum() + (v != 0).sum()
    rows = kv.token_rows(slots)
    if rows is not None:
        assert torch.equal(starts, rows * per_token)


def test_a_block_fits_tile_by_tile_into_holes_no_whole_block_fits():
    """Holes smaller than a whole block but holding tiles are KV space: what lowering a
    plane frees needs no compaction before the KV cache can use it."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv_config = KVCacheConfig(block_size=2)
    probe = PagedKVCache(config, kv_config, torch.float32, "cpu")
    L = config.num_layers
    assert L > 1
    pool, arena = make_arena(2 * L, probe.tile_bytes)  # room for 2 blocks' tiles, no more
    kv = PagedKVCache(config, kv_config, torch.float32, "cpu", arena=arena)
    pieces = [arena.allocate(OTHER_WEIGHTS, kv.tile_bytes) for _ in range(arena.num_pages // arena.pages_for(kv.tile_bytes))]
    for x in pieces[::2]:  # every other tile-sized piece freed: no two free tiles adjacent
        arena.free(x)
    assert arena.largest_free_run() < arena.pages_for(kv.block_bytes)
    assert kv.grow(10) == len(pieces[::2]) // L
    assert pool.bytes_of(KV_FREE) == kv.reserved_bytes == kv.num_blocks * L * arena.charged_bytes(kv.tile_bytes)
    arena.check_consistent()


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_grow_zeroes_exactly_the_new_tiles_pages(device):
    """Growing places tiles in holes among other extents and zeroes them in one launch
    (no per-tile loop, no synchronising upload): every page of every new tile reads 0,
    every other page keeps its bytes, and the tile-row table points at the new tiles."""
    config, arena, kv = _cache_in_small_arena(device)
    fillers = [arena.allocate(OTHER_WEIGHTS, (1 + i % 2) * kv.tile_bytes) for i in range(30)]
    for x in fillers[::3]:
        arena.free(x)
    pattern = torch.randn(arena.num_pages * kv.row_stride, generator=torch.Generator().manual_seed(3)).to(device)
    kv.flat.copy_(pattern)
    assert kv.grow(8) == 8
    pages = kv.flat.view(arena.num_pages, kv.row_stride)
    before = pattern.view(arena.num_pages, kv.row_stride)
    tile_pages = {x.first_page + i for tiles in kv._tiles.values() for x in tiles for i in range(x.num_pages)}
    assert len(tile_pages) == 8 * config.num_layers * arena.pages_for(kv.tile_bytes)
    for page in range(arena.num_pages):
        if page in tile_pages:
            assert not pages[page].any(), page
        else:
            assert torch.equal(pages[page], before[page]), page
    for block_id, tiles in kv._tiles.items():
        assert kv._tile_row[:, block_id].tolist() == [x.first_page for x in tiles]


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_blocks_grown_over_nan_bytes_give_finite_batched_attention(device):
    """The arena's pages may hold anything (weights' planes read as NaN in bf16 or fp32):
    the batched path reads whole blocks, so unwritten positions of a block must not be NaN,
    or 0 * NaN poisons the output of every sequence in that block. New tiles start at 0:
    the batched path equals the reference path, finite."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv_config = KVCacheConfig(block_size=4)
    probe = PagedKVCache(config, kv_config, torch.float32, "cpu")
    pool = MemoryPool(budget_bytes=8 * probe.block_bytes + 1000)
    arena = Arena.from_pool(pool, page_bytes=1024, device=device)
    arena.storage.fill_(0xFF)  # every float reads as NaN
    kv = PagedKVCache(config, kv_config, torch.float32, device, arena=arena)
    assert kv.grow(8) == 8
    ids = sorted(kv.manager.take_free_blocks(8))
    kv.manager.add_blocks(ids)
    tables = [[ids[2], ids[5]], [ids[0]]]  # 6 and 3 tokens: both last blocks partly filled
    G, D, N = config.num_kv_heads, config.head_dim, config.num_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, N, D, generator=gen).to(device)
    k, v = torch.randn(9, G, D, generator=gen).to(device), torch.randn(9, G, D, generator=gen).to(device)
    out = {}
    for impl in ("reference", "batched"):
        step = build_step(kv, [SeqSlice(tables[0], 6, 6), SeqSlice(tables[1], 3, 3)], impl)
        out[impl] = paged_attention(1, q, k, v, step)
    assert torch.isfinite(out["batched"]).all()
    torch.testing.assert_close(out["batched"], out["reference"])
