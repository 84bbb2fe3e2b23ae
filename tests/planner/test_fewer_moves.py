"""Lowering plans that move fewer blocks further (planner/fewer_moves.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS
from pagedweight.planner.fewer_moves import free_with_fewer_moves, move_cost_scale, raise_whole
from pagedweight.planner.greedy import free_bytes, spend_bytes
from tests.weights.conftest import build


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


def test_whole_raises_take_the_best_blocks_straight_to_their_ceiling_within_the_bytes():
    nbytes, damage = table()
    n = len(nbytes)
    rows = np.arange(n)
    bits = np.array([3, 4, 5, 6, 7, 8])[rows % 6]
    ceilings = np.where(rows % 5 == 0, 7, 8)
    limit = int(0.05 * nbytes[:, -1].sum())
    new = raise_whole(damage, nbytes, bits, ceilings, limit)
    moved = np.flatnonzero(new != bits)
    cost = lambda b: nbytes[rows, b - MIN_BITS]
    assert moved.size and (new >= bits).all() and (new[moved] == ceilings[moved]).all()
    assert (cost(new) - cost(bits)).sum() <= limit
    # best damage saved per byte first: no block left below its ceiling beats a raised one
    top = np.maximum(ceilings, bits)
    ratio = (damage[rows, bits - MIN_BITS] - damage[rows, top - MIN_BITS]) / np.maximum(cost(top) - cost(bits), 1)
    left = np.flatnonzero((new == bits) & (top > bits))
    assert ratio[moved].min() >= ratio[left].max()
    # the one-bit greedy spends the same bytes on many more blocks
    greedy = spend_bytes(damage, nbytes, bits, ceilings, limit).bits
    assert np.count_nonzero(greedy != bits) > 2 * moved.size
    smallest = (cost(top) - cost(bits))[top > bits].min()
    assert raise_whole(damage, nbytes, bits, ceilings, smallest - 1) is None  # not one whole raise fits


def test_a_planner_with_a_move_cost_answers_a_spend_with_whole_raises():
    from pagedweight.planner.messages import KVPressure, PlanRequest
    from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
    from pagedweight.weights.synthetic import random_blocks

    blocks = random_blocks(num_layers=2, num_experts=6, hidden=64, intermediate=96, seed=3)
    _, _, table_, mover = build(blocks, 1 << 22)
    registration = page_table_registration(table_.charged_bytes_table(), top_k=2)
    mover.close()
    nbytes = registration.nbytes
    low = np.full(len(nbytes), 4)
    spare = int((nbytes[:, -1] - nbytes[:, 4 - MIN_BITS]).sum() * 0.4)  # 40 % of what all of them back takes
    moved = {}
    for cost in (0.0, 16.0):
        planner = InProcessPlanner("pagedweight", move_cost=cost)
        planner.register(registration)
        planner.submit(PlanRequest(1, KVPressure(bytes_free=spare), low))
        changes = planner.poll().changes()
        new = low.copy()
        new[list(changes)] = list(changes.values())
        assert (new >= low).all() and (nbytes[np.arange(len(new)), new - MIN_BITS]
                                       - nbytes[np.arange(len(new)), low - MIN_BITS]).sum() <= spare
        moved[cost] = changes
    assert set(moved[0.0].values()) != {8}  # the greedy raises blocks part of the way
    assert moved[16.0] and set(moved[16.0].values()) == {8}  # each raised block lands whole
    assert len(moved[16.0]) < len(moved[0.0])
