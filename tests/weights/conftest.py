"""Fixtures for the runtime tests: synthetic APL blocks in a small arena."""

from __future__ import annotations

import pytest
import torch

from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_KINDS, MemoryPool, TRANSIT, expert_kind
from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks

PAGE = 512


def build(blocks, budget_bytes, page_bytes=PAGE, initial_bits=8, before_copy=None):
    """(pool, arena, table, mover) with every block loaded at `initial_bits` and the
    arena's free pages poisoned with 0xFF, so a read of an unwritten page shows."""
    pool = MemoryPool(budget_bytes)
    arena = Arena.from_pool(pool, page_bytes)
    arena.storage.fill_(0xFF)
    table = PageTable(blocks, arena, initial_desired_bits=initial_bits)
    mover = PageMover(table, before_copy=before_copy)
    mover.load_all()
    return pool, arena, table, mover


def full_bytes(blocks, page_bytes=PAGE) -> int:
    """The pool bytes of every block at 8 bits: measured on a throw-away build, so budgets
    in the tests can say "full + n KV blocks"."""
    pool, _, _, mover = build(blocks, 64 << 20, page_bytes)
    full = pool.reserved_bytes
    mover.close()
    return full


def check_accounting(pool, arena, table, mover):
    """Every byte accounted by kind: the pool's kinds equal what the page table, the
    mover and the arena hold, and the total equals the arena's used pages."""
    s = pool.snapshot()
    arena.check_consistent()
    assert s.reserved_bytes <= s.budget_bytes
    assert s.peak_reserved_bytes <= s.budget_bytes
    by_kind = {}
    for x in arena.live_extents():
        by_kind[x.kind] = by_kind.get(x.kind, 0) + x.num_pages * arena.page_bytes
    for bits in BIT_WIDTHS:
        expected = sum(table.charged_bytes(bid, bits) for bid, e in table.entries.items() if e.committed_bits == bits)
        assert s.expert_bytes_by_bits[bits] == expected == by_kind.get(expert_kind(bits), 0)
    transit = sum(x.num_pages for x in mover.in_transit_extents()) * arena.page_bytes
    assert s.transit_bytes == transit == by_kind.get(TRANSIT, 0)
    assert s.kv_used_bytes + s.kv_free_bytes == sum(by_kind.get(k, 0) for k in KV_KINDS)
    outside = s.other_weight_bytes + s.workspace_bytes
    assert s.reserved_bytes == arena.used_bytes + outside


@pytest.fixture
def small_blocks():
    return random_blocks(num_layers=2, num_experts=3, hidden=64, intermediate=96, seed=1)


def static_weight(table, block_id, bits=None):
    """The static model's weight at `bits` (default: committed), from host memory."""
    bits = bits or table.entries[block_id].committed_bits
    return table.host[block_id].dequantize(bits).float()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
