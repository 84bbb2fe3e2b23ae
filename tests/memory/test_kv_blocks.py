"""The KV block manager and the chunked KV cache: exact block accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.memory.kv_cache import KVBlockManager, KVCacheConfig, PagedKVCache
from services.worker.model.config import ModelConfig
from services.worker.model.paged_attention import SeqSlice, build_step, paged_attention
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


def test_lowest_blocks_first_so_high_chunks_drain():
    manager = KVBlockManager(block_size=2)
    manager.add_blocks(range(0, 8))
    a, b = Seq(0), Seq(1)
    manager.allocate(a, 5)
    manager.allocate(b, 3)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    manager.free(a)
    manager.allocate(b, 8)
    assert b.block_ids == [3, 4, 0, 1]


class CountingPool:
    """The smallest real byte pool: a budget and bytes by kind."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, {}

    def can_allocate(self, kind, num_bytes):
        return sum(self.used.values()) + num_bytes <= self.budget

    def allocate(self, kind, num_bytes):
        assert self.can_allocate(kind, num_bytes)
        self.used[kind] = self.used.get(kind, 0) + num_bytes

    def free(self, kind, num_bytes):
        assert self.used.get(kind, 0) >= num_bytes
        self.used[kind] -= num_bytes


def test_cache_grows_from_pool_and_shrinks_only_free_trailing_chunks():
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv_config = KVCacheConfig(block_size=4, chunk_blocks=2)
    probe = PagedKVCache(config, kv_config, torch.float32, "cpu")
    pool = CountingPool(budget=3 * probe.chunk_bytes + 1)
    kv = PagedKVCache(config, kv_config, torch.float32, "cpu", pool)
    assert kv.grow(100) == 6 and kv.num_blocks == 6  # the budget holds three chunks
    assert pool.used["kv"] == 3 * kv.chunk_bytes == kv.reserved_bytes
    seq = Seq(0)
    kv.manager.allocate(seq, 9)  # blocks 0, 1, 2: chunks 0 and 1
    assert kv.used_bytes == 3 * kv.block_bytes
    assert kv.shrink() == kv.chunk_bytes  # only chunk 2 is free
    assert kv.num_blocks == 4 and pool.used["kv"] == 2 * kv.chunk_bytes
    kv.manager.free(seq)
    assert kv.shrink(keep_free_blocks=2) == kv.chunk_bytes and kv.num_blocks == 2
    assert kv.shrink() == kv.chunk_bytes and kv.num_blocks == 0 and pool.used["kv"] == 0


def test_values_survive_across_chunks():
    """Tokens written through one table read back the same, wherever their blocks live."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv = PagedKVCache(config, KVCacheConfig(block_size=2, chunk_blocks=2), torch.float32, "cpu")
    kv.grow(8)
    seqs = [SeqSlice([5, 0, 3], 6, 6), SeqSlice([1, 6], 3, 3)]
    step = build_step(kv, seqs, "reference")
    G, D = config.num_kv_heads, config.head_dim
    k, v = torch.randn(9, G, D), torch.randn(9, G, D)
    q = torch.randn(9, config.num_heads, D)
    paged_attention(1, q, k, v, step)
    keys, values = kv.read_slots(1, step.context_slots, 9)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert torch.equal(kv.chunks[2][1, 0, 1, 1], k[1])  # token 1 of seq 0: block 5 = chunk 2, block 1
