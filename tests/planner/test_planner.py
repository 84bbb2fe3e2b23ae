"""Static solve and the online planner: budget, floors, hysteresis and convergence."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.planner import OnlinePlanner, plan_bytes, solve
from pagedweight.planner.routing_stats import RoutingStats
from tests.planner.strategies import block_tables, random_table

MIN, MAX = 3, 8


@settings(max_examples=150, deadline=None)
@given(block_tables(), st.integers(0, 2**31 - 1), st.floats(2.5, 8.5))
def test_solve_fits_budget_and_keeps_floors_when_it_can(table, seed, avg_bits):
    rng = np.random.default_rng(seed)
    floors = np.where(rng.random(table.num_blocks) < 0.3, rng.integers(MIN, MAX + 1, table.num_blocks), MIN)
    budget = table.uniform_bytes(min(max(avg_bits, 3), 8))
    if avg_bits < 3:
        budget = int(budget * avg_bits / 3)  # below the all-3-bit bytes: infeasible
    plan = solve(table.nbytes, table.sensitivity, budget, floors)
    assert plan.num_bytes == plan_bytes(table.nbytes, plan.bits)
    assert np.all((plan.bits >= MIN) & (plan.bits <= MAX))
    all_min = table.uniform_bytes(3)
    if budget >= all_min:
        assert plan.num_bytes <= budget and plan.shortfall == 0
    else:
        assert np.all(plan.bits == MIN) and plan.shortfall == all_min - budget
    if budget >= plan_bytes(table.nbytes, floors):
        assert np.all(plan.bits >= floors) and not plan.floors_relaxed
    else:
        assert plan.floors_relaxed


def test_more_budget_never_predicts_more_damage():
    """Format 2's LUT bytes (8 entries at 3 bits, 17 from 4 up) make the 4 -> 3 step free more
    than the steps above it; the greedy must still never predict more damage for more budget."""
    for seed in range(40):
        table = random_table(2, 4, seed)
        floors = np.full(table.num_blocks, MIN)
        damages = [solve(table.nbytes, table.sensitivity, table.uniform_bytes(b), floors).damage
                   for b in np.linspace(3, 8, 21)]
        assert all(a >= b - 1e-12 for a, b in zip(damages, damages[1:])), seed


def make_online(table, config=PlannerConfig(), start_bits=MAX):
    model = DamageModel(table, config)
    return OnlinePlanner(table, model, np.full(table.num_blocks, start_bits), config)


@settings(max_examples=60, deadline=None)
@given(block_tables(), st.lists(st.floats(3.0, 8.0), min_size=1, max_size=12))
def test_online_plans_never_exceed_the_budget(table, widths):
    planner = make_online(table)
    for width in widths:
        budget = table.uniform_bytes(width)
        plan = planner.plan(budget)
        assert plan.num_bytes <= budget
        assert plan.num_bytes == table.bytes_of(planner.bits)


@settings(max_examples=60, deadline=None)
@given(block_tables(), st.floats(3.2, 7.5))
def test_steady_load_converges_to_a_steady_plan(table, width):
    planner = make_online(table)
    budget = table.uniform_bytes(width)
    plans = [planner.plan(budget).bits for _ in range(40)]
    assert all(np.array_equal(plans[-1], p) for p in plans[-10:])
    assert table.bytes_of(plans[-1]) <= budget


def test_steady_noisy_routing_converges():
    """Routing sampled from one fixed distribution: hysteresis stops the plan from flapping."""
    table = random_table(3, 8, 1)
    config = PlannerConfig(routing_half_life_tokens=256)
    planner = make_online(table, config)
    stats = RoutingStats(3, 8, top_k=2, half_life_tokens=config.routing_half_life_tokens)
    rng = np.random.default_rng(0)
    popularity = rng.dirichlet(np.ones(8) * 0.7, size=3)
    budget = table.uniform_bytes(4.2)
    history = []
    for _ in range(60):
        for layer in range(3):
            ids = np.stack([rng.choice(8, size=2, replace=False, p=popularity[layer]) for _ in range(64)])
            stats.observe(layer, ids, rng.uniform(0.3, 0.7, size=ids.shape))
        history.append(planner.plan(budget, DamageInputs(stats.relative_mass())).bits)
    changes = [int((a != b).sum()) for a, b in zip(history, history[1:])]
    assert sum(changes[-20:]) == 0, changes


def test_hot_expert_gets_more_bits_after_traffic_shifts():
    """Routing moves to one expert: the online planner rebalances bits toward its blocks."""
    table = random_table(1, 4, 7)
    config = PlannerConfig(rebalance_fraction=0.2)
    planner = make_online(table, config)
    budget = table.uniform_bytes(4.5)
    flat = DamageInputs(np.ones((1, 4)))
    for _ in range(5):
        planner.plan(budget, flat)
    hot_expert = int(np.argmin(planner.bits.reshape(4, 2).sum(axis=1)))
    before = planner.bits.reshape(4, 2)[hot_expert].sum()
    hot = np.full((1, 4), 0.1)
    hot[0, hot_expert] = 3.7
    for _ in range(10):
        plan = planner.plan(budget, DamageInputs(hot))
        assert plan.num_bytes <= budget
    assert planner.bits.reshape(4, 2)[hot_expert].sum() > before
