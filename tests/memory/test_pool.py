"""The memory pool: one budget, exact bytes by kind, and --memory-budget parsing."""

import pytest

from pagedweight.common.errors import UserError
from pagedweight.memory.pool import (
    KV_FREE, KV_USED, OTHER_WEIGHTS, TRANSIT, WORKSPACE, BudgetExceeded, MemoryBudgetError, MemoryPool,
    expert_kind, parse_memory_budget,
)


def test_allocate_never_exceeds_the_budget():
    pool = MemoryPool(1000)
    pool.allocate(OTHER_WEIGHTS, 600)
    assert pool.can_allocate(KV_USED, 400) and not pool.can_allocate(KV_USED, 401)
    with pytest.raises(BudgetExceeded):
        pool.allocate(KV_USED, 401)
    assert pool.reserved_bytes == 600  # the failed allocation changed nothing
    pool.allocate(KV_USED, 400)
    assert pool.free_bytes == 0


def test_free_and_move_keep_every_byte_accounted():
    pool = MemoryPool(10_000)
    pool.allocate(expert_kind(8), 4000)
    pool.allocate(TRANSIT, 500)
    pool.allocate(WORKSPACE, 1000)
    pool.allocate(KV_FREE, 2000)
    pool.move(TRANSIT, expert_kind(8), 500)
    pool.move(expert_kind(8), expert_kind(4), 1500)
    pool.move(KV_FREE, KV_USED, 1200)
    with pytest.raises(ValueError):
        pool.free(KV_USED, 1201)
    with pytest.raises(ValueError):
        pool.move(TRANSIT, KV_USED, 1)
    s = pool.snapshot()
    assert s.expert_bytes_by_bits[8] == 3000 and s.expert_bytes_by_bits[4] == 1500
    assert (s.transit_bytes, s.kv_used_bytes, s.kv_free_bytes, s.workspace_bytes) == (0, 1200, 800, 1000)
    parts = s.expert_bytes + s.other_weight_bytes + s.workspace_bytes + s.kv_used_bytes + s.kv_free_bytes + s.transit_bytes
    assert parts == s.reserved_bytes == 7500
    assert s.in_use_bytes == 7500 - 800


def test_peak_in_use_leaves_out_empty_kv_blocks():
    pool = MemoryPool(10_000)
    pool.allocate(KV_FREE, 5000)
    pool.allocate(expert_kind(3), 1000)
    pool.move(KV_FREE, KV_USED, 3000)
    pool.free(KV_USED, 3000)
    s = pool.snapshot()
    assert s.peak_in_use_bytes == 4000 and s.peak_reserved_bytes == 6000


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown memory kind"):
        MemoryPool(10).allocate("weights", 1)
    with pytest.raises(ValueError):
        expert_kind(9)


@pytest.mark.parametrize("text, total, expected", [
    ("123456", None, 123456), ("8GiB", None, 8 << 30), ("512M", None, 512 << 20), ("4 kb", None, 4096),
    ("0.5", 1000, 500), ("90%", 2000, 1800), ("1.0", 64, 64),
])
def test_parse_memory_budget(text, total, expected):
    assert parse_memory_budget(text, total) == expected


@pytest.mark.parametrize("text, total", [("0.5", None), ("1.5", 100), ("lots", None), ("12XB", None),
                                         ("0", None), ("2000", 1000), ("abc%", 100)])
def test_parse_memory_budget_rejects_bad_values(text, total):
    with pytest.raises(MemoryBudgetError) as err:
        parse_memory_budget(text, total)
    assert isinstance(err.value, UserError) and "--memory-budget" in str(err.value)
