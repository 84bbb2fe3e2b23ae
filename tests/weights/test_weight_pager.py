"""The weight pager on micro-mixtral: the split between expert bits and KV blocks moves
with random pressure while every forward step equals the static model at the committed
bits, the budget holds at every instant and every byte stays accounted."""

import random
import threading

import pytest
import torch

from conftest import build, check_accounting, full_bytes
from pagedweight.memory.pool import KV_USED
from pagedweight.model.loader import load_model
from pagedweight.weights.arena_experts import install_arena_experts
from tests.weights.greedy_planner import GreedyPlanner
from pagedweight.weights.synthetic import blocks_from_model
from pagedweight.weights.weight_pager import WeightPager, fewest_block_drops, fewest_plane_drops
from pagedweight.format.apl_format import BlockId

KV_BLOCK_BYTES = 4 * 512
BIG_KV_BLOCK_BYTES = 128 * 512  # experts at 8 bits hold ~210 of these


@pytest.fixture(scope="module")
def micro(bundled_model_dir):
    model = load_model(bundled_model_dir, dtype=torch.float32)
    return model, blocks_from_model(model)


def make_pager(micro, extra_bytes, before_copy=None, kv_block_bytes=None):
    model, blocks = micro
    full = full_bytes(blocks)  # every block at 8 bits
    pool, arena, table, mover = build(blocks, full + extra_bytes, before_copy=before_copy)
    return pool, arena, table, mover, WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), kv_block_bytes)


class StaticModel:
    """The same model with dense experts holding the host weights at given bits."""

    def __init__(self, model, table):
        self.model, self.table, self._cache = model, table, {}

    def logits(self, ids, bits):  # bits: block_id -> bits
        for layer, moe in enumerate(self.model.moe_blocks):
            with torch.no_grad():
                for e in range(moe.experts.num_experts):
                    for module, param in (("gate_up", moe.experts.gate_up), ("down", moe.experts.down)):
                        bid = BlockId(layer, e, module)
                        key = (bid, bits[bid])
                        if key not in self._cache:
                            self._cache[key] = self.table.host[bid].dequantize(bits[bid]).float()
                        param[e].copy_(self._cache[key])
        with torch.no_grad():
            return self.model(ids)


@pytest.fixture
def models(micro, bundled_model_dir):
    static = load_model(bundled_model_dir, dtype=torch.float32)
    paged = load_model(bundled_model_dir, dtype=torch.float32)
    return static, paged


def test_split_moves_with_random_pressure_and_steps_match_the_static_model(micro, models):
    static_model, paged_model = models
    rng = random.Random(0)
    copies_may_land = threading.Event()  # cleared: copies stay in flight across steps
    copies_may_land.set()
    pool, arena, table, mover, pager = make_pager(micro, 16 * BIG_KV_BLOCK_BYTES, copies_may_land.wait,
                                                  BIG_KV_BLOCK_BYTES)
    copies_may_land.clear()
    install_arena_experts(paged_model, table)
    static = StaticModel(static_model, table)
    ids = torch.tensor([[1, 17, 250, 3000, 42, 7, 99, 1234]])
    kv, means, num_waits = [], [], 0
    for step in range(40):
        if rng.random() < 0.6:  # load rises: the KV cache wants more blocks
            want = rng.randint(1, 30)
            for _ in range(want):
                if not arena.can_allocate(KV_USED, BIG_KV_BLOCK_BYTES):
                    pager.request_bytes(BIG_KV_BLOCK_BYTES * want)
                    num_waits += 1
                    break
                kv.append(arena.allocate(KV_USED, BIG_KV_BLOCK_BYTES))
                want -= 1
        else:  # load falls: sequences finish, spare bytes go back to the weights
            for _ in range(rng.randint(0, len(kv))):
                arena.free(kv.pop(rng.randrange(len(kv))))
            pager.offer_bytes(pool.free_bytes - 4 * BIG_KV_BLOCK_BYTES)
        committed = table.committed_bits()
        out = paged_model(ids)
        assert torch.equal(out, static.logits(ids, committed)), f"step {step}"
        if rng.random() < 0.5:  # the copies started so far land before this boundary
            copies_may_land.set()
            mover.wait_for_transits()
            copies_may_land.clear()
        pager.step_boundary()
        check_accounting(pool, arena, table, mover)
        means.append(pager.stats().mean_committed_bits)
    rises = sum(b > a for a, b in zip(means, means[1:]))
    falls = sum(b < a for a, b in zip(means, means[1:]))
    assert num_waits > 3 and min(means) < 7.75 and rises > 2 and falls > 2, (num_waits, means)

    copies_may_land.set()
    for x in kv:  # drain: every bit comes back
        arena.free(x)
    for _ in range(50):
        pager.offer_bytes(pool.free_bytes)
        pager.step_boundary()
        if not pager.busy():
            break
        mover.wait_for_transits()
    stats = pager.stats()
    assert stats.mean_committed_bits == 8 and stats.mean_committed_bits_min < 7.75
    assert torch.equal(paged_model(ids), static.logits(ids, table.committed_bits()))
    assert pool.snapshot().peak_reserved_bytes <= pool.budget_bytes
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_bytes_asked_for_become_kv_blocks(micro):
    pool, arena, table, mover, pager = make_pager(micro, 0)
    assert not arena.can_allocate(KV_USED, KV_BLOCK_BYTES)
    num_blocks = 100
    promised = pager.request_bytes(num_blocks * KV_BLOCK_BYTES)
    assert promised >= num_blocks * KV_BLOCK_BYTES and pager.busy()
    result = pager.step_boundary()
    assert result.num_bytes_freed - result.num_bytes_taken == promised
    kv = [arena.allocate(KV_USED, KV_BLOCK_BYTES) for _ in range(num_blocks)]  # no fragmentation left
    assert len(kv) == num_blocks and not pager.busy()
    stats = pager.stats()
    assert stats.num_plans == 1 and stats.mean_committed_bits < 8
    assert sum(stats.bits_histogram.values()) == len(table.entries)
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_fewest_plane_drops_is_the_smallest_set_of_drops_that_frees_the_bytes():
    """Against every subset of the blocks' available drops (each block's order aside), on small
    random tables; and a block at 3 bits offers none."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 4))
        drop_bytes = rng.integers(1, 50, size=(n, 5))
        bits = rng.integers(3, 9, size=n)
        available = [int(drop_bytes[i, k]) for i in range(n) for k in range(bits[i] - 3)]
        num_bytes = int(rng.integers(1, sum(available) + 2)) if available else 1
        fewest = min((len(c) for r in range(len(available) + 1) for c in itertools.combinations(available, r)
                      if sum(c) >= num_bytes), default=len(available))
        assert fewest_plane_drops(drop_bytes, bits, num_bytes) == fewest, (drop_bytes, bits, num_bytes)
    assert fewest_plane_drops(np.ones((2, 5), dtype=np.int64), np.array([3, 3]), 10) == 0
    assert fewest_plane_drops(np.ones((1, 5), dtype=np.int64), np.array([8]), 0) == 0


def test_fewest_block_drops_is_the_smallest_set_of_blocks_that_frees_the_bytes():
    """Against every subset of the blocks, each lowered as far as it goes, on small random tables;
    a block at 3 bits frees nothing, and every block that can go lower where all fall short."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(1, 5))
        drop_bytes = rng.integers(1, 50, size=(n, 5))
        bits = rng.integers(3, 9, size=n)
        whole = [int(drop_bytes[i, :bits[i] - 3].sum()) for i in range(n) if bits[i] > 3]
        num_bytes = int(rng.integers(1, sum(whole) + 2)) if whole else 1
        fewest = min((len(c) for r in range(len(whole) + 1) for c in itertools.combinations(whole, r)
                      if sum(c) >= num_bytes), default=len(whole))
        assert fewest_block_drops(drop_bytes, bits, num_bytes) == fewest, (drop_bytes, bits, num_bytes)
    assert fewest_block_drops(np.ones((2, 5), dtype=np.int64), np.array([3, 3]), 10) == 0
    assert fewest_block_drops(np.ones((1, 5), dtype=np.int64), np.array([8]), 0) == 0


def test_a_free_plan_counts_its_planes_against_the_fewest(micro):
    """The stats count every plane a free plan lowers and the fewest that free the bytes it was
    asked for: no fewer than that, and the greedy planner's few more (it picks least damage)."""
    pool, arena, table, mover, pager = make_pager(micro, 0)
    pager.request_bytes(100 * KV_BLOCK_BYTES)
    pager.step_boundary()
    stats = pager.stats()
    before = {bid: 8 for bid in table.entries}
    lowered = sum(before[bid] - e.desired_bits for bid, e in table.entries.items())
    assert stats.num_planes_lowered == lowered > 0
    assert 0 < stats.num_planes_lowered_fewest <= stats.num_planes_lowered
    # and the blocks it lowered (a page move each) against the fewest, the bytes against those asked
    assert stats.num_blocks_lowered == sum(e.desired_bits < 8 for e in table.entries.values()) > 0
    assert 0 < stats.num_blocks_lowered_fewest <= stats.num_blocks_lowered
    assert stats.num_bytes_asked == 100 * KV_BLOCK_BYTES
    assert stats.num_bytes_freed == sum(table.charged_bytes(bid, 8) - table.charged_bytes(bid, e.desired_bits)
                                        for bid, e in table.entries.items()) > 0
    mover.close()


def test_request_cancels_raises_not_started_and_offer_waits_for_pressure_to_fall(micro):
    pool, arena, table, mover, pager = make_pager(micro, 0)
    pager.request_bytes(50 * KV_BLOCK_BYTES)
    assert pager.offer_bytes(10 * KV_BLOCK_BYTES) == 0  # lowerings still pending
    pager.step_boundary()
    low = table.committed_bits()
    assert pager.offer_bytes(pool.free_bytes) > 0
    pager.request_bytes(0)  # pressure before the next boundary: the planned raises are dropped
    assert table.desired_bits() == low
    mover.close()


def test_compaction_learns_the_kv_block_size_and_makes_the_bytes_asked_for_usable(micro):
    pool, arena, table, mover, pager = make_pager(micro, 3 * BIG_KV_BLOCK_BYTES)
    kv = [arena.allocate(KV_USED, BIG_KV_BLOCK_BYTES) for _ in range(3)]
    assert arena.last_kv_bytes == BIG_KV_BLOCK_BYTES
    pager.request_bytes(20 * BIG_KV_BLOCK_BYTES)
    pager.step_boundary()
    per_block = arena.pages_for(BIG_KV_BLOCK_BYTES)
    assert arena.num_free_pages // per_block >= arena.num_fitting(BIG_KV_BLOCK_BYTES) >= 20
    kv += [arena.allocate(KV_USED, BIG_KV_BLOCK_BYTES) for _ in range(20)]
    check_accounting(pool, arena, table, mover)
    mover.close()


def test_a_raise_that_cannot_start_is_dropped_not_waited_on_for_ever(small_blocks):
    # Budget: exactly every block at 8 bits. Lower one block to 7, then ask for 8 again:
    # the net bytes are free, but in flight the raise needs LUT_8 beside LUT_7.
    full = full_bytes(small_blocks)
    pool, arena, table, mover = build(small_blocks, full)
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()))
    bid = next(iter(table.entries))
    table.set_desired_bits({bid: 7})
    pager.step_boundary()
    assert table.entries[bid].committed_bits == 7
    table.set_desired_bits({bid: 8})
    for _ in range(3):
        pager.step_boundary()
        check_accounting(pool, arena, table, mover)
    assert not pager.busy() and pager.num_raises_dropped == 1
    assert table.entries[bid].desired_bits == table.entries[bid].committed_bits == 7
    assert pager.offer_bytes(pool.free_bytes) == 0  # the same bytes are not planned again
    mover.close()


def test_a_plan_that_answers_steps_later_is_applied_when_it_arrives(micro):
    """A remote planner answers at a later boundary: the pager counts the asked bytes as
    pending meanwhile, asks nothing twice, and lowers only once the answer is there."""
    model, blocks = micro
    full = full_bytes(blocks)
    pool, arena, table, mover = build(blocks, full)
    planner = GreedyPlanner(table.charged_bytes_table(), answer_after_polls=3)  # submit polls once too
    pager = WeightPager(mover, planner)
    free_before = pool.free_bytes
    assert pager.request_bytes(1 << 16) == 1 << 16  # in flight: the asked bytes are pending
    assert pager.request_bytes(1 << 16) == 1 << 16 and len(planner.requests) == 1
    assert pager.offer_bytes(1 << 20) == 0  # no spend while a free is in flight
    pager.step_boundary()  # first poll: not answered yet, nothing lowered
    assert pool.free_bytes == free_before and all(e.desired_bits == 8 for e in table.entries.values())
    pager.step_boundary()  # second poll: still nothing
    assert pool.free_bytes == free_before
    pager.step_boundary()  # answered: applied, and the lowerings drop their planes at once
    assert pool.free_bytes - free_before >= 1 << 16
    assert pager.request_bytes(1 << 16) == 1 << 16 and len(planner.requests) == 2  # a new need, a new request
    for _ in range(4):
        pager.step_boundary()
    check_accounting(pool, arena, table, mover)
    mover.close()
