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
    kv.allocate(a, 9)  # three blocks, highest pages first
    kv.allocate(b, 1)
    assert a.block_ids == sorted(a.block_ids, reverse=True) and min(a.block_ids) > max(b.block_ids)
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
