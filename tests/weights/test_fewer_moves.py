"""Lowering plans that move fewer blocks further (weights/fewer_moves.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS
from pagedweight.planner.greedy import free_bytes
from pagedweight.weights.fewer_moves import free_with_fewer_moves, move_cost_scale


def table(n=200, seed=0):
    rng = np.random.default_rng(seed)
    size = rng.integers(1000, 5000, n)[:, None]
    widths = np.array(BIT_WIDTHS)[None, :]
    nbytes = size * widths + 64 * widths  # planes plus a LUT that grows with bits
    damage = rng.uniform(0.5, 2.0, n)[:, None] * size * np.power(4.0, -widths)
    return nbytes.astype(np.int64), damage


@pytest.mark.parametrize("move_cost", [0.0, 4.0, 64.0])
def test_frees_the_target_within_floors_and_only_lowers(move_cost):
    nbytes, damage = table()
    bits = np.full(len(nbytes), 8)
    floors = np.where(np.arange(len(bits)) % 7 == 0, 6, MIN_BITS)
    target = int(0.15 * nbytes[:, -1].sum())
    scale = move_cost_scale(damage, bits, floors)
    new = free_with_fewer_moves(damage, nbytes, bits, floors, target, move_cost * scale)
    rows = np.arange(len(bits))
    assert new is not None and (new <= bits).all() and (new >= floors).all()
    assert nbytes[rows, bits - MIN_BITS].sum() - nbytes[rows, new - MIN_BITS].sum() >= target


def test_a_move_cost_moves_fewer_blocks_than_the_one_bit_greedy_for_a_little_damage():
    nbytes, damage = table()
    bits, floors = np.full(len(nbytes), 8), np.full(len(nbytes), MIN_BITS)
    target = int(0.1 * nbytes[:, -1].sum())
    greedy = free_bytes(damage, nbytes, bits, floors, target)
    scale = move_cost_scale(damage, bits, floors)
    rows = np.arange(len(bits))
    plan_damage = lambda b: damage[rows, b - MIN_BITS].sum() - damage[rows, bits - MIN_BITS].sum()
    moved = []
    for cost in (0.0, 16.0, 256.0):
        new = free_with_fewer_moves(damage, nbytes, bits, floors, target, cost * scale)
        moved.append(int(np.count_nonzero(new != bits)))
        if cost == 0.0:  # no cost per move: as good as the greedy's damage (within its overshoot)
            assert plan_damage(new) <= 1.05 * greedy.damage_delta
    assert moved[0] >= len(greedy.moved_ids) * 0.9
    assert moved[0] > moved[1] > moved[2]  # each costlier move takes fewer blocks


def test_none_when_the_floors_cannot_free_the_target():
    nbytes, damage = table(20)
    bits = np.full(20, 8)
    assert free_with_fewer_moves(damage, nbytes, bits, np.full(20, 8), 1, 1.0) is None
    target = int(nbytes[:, -1].sum() - nbytes[:, 0].sum()) + 1  # more than all at 3 bits frees
    assert free_with_fewer_moves(damage, nbytes, bits, np.full(20, 3), target, 1.0) is None


def test_runtime_with_a_move_cost_moves_fewer_blocks_under_the_same_load(paged_micro_dir):
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.runtime import RuntimeConfig, build_runtime
    from tests.test_runtime import ENGINE, MAX_TOKENS, check_pool, fixed_budget, prompts

    moves = {}
    for cost in (0.0, 64.0):
        runtime = build_runtime(paged_micro_dir, RuntimeConfig(fixed_budget(paged_micro_dir, 8, 40), "pagedweight",
                                                               engine=ENGINE, move_cost=cost))
        try:
            engine = runtime.engine
            before = runtime.mover.counters.num_lowerings
            for i, p in enumerate(prompts() * 2):
                engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            while engine.has_work:
                engine.step()
                check_pool(runtime)
            assert engine.stats().num_preemptions == 0
            moves[cost] = runtime.mover.counters.num_lowerings - before
        finally:
            runtime.close()
    assert 0 < moves[64.0] < moves[0.0]
