"""Each damage-model and hysteresis coefficient of PlannerConfig moves what the planner
computes in the direction its comment says (the rest: test_planner.py, test_damage_and_policies.py)."""

from __future__ import annotations

import numpy as np

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.planner import OnlinePlanner
from pagedweight.planner.synthetic import synthetic_table

TABLE = synthetic_table(num_layers=2, num_experts=4, hidden=64, intermediate=32, seed=3)


def test_routing_exponent_sets_how_strongly_routing_mass_scales_damage():
    mass = np.array([[4.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    flat = DamageModel(TABLE, PlannerConfig(routing_exponent=0.0)).multipliers(DamageInputs(mass))
    linear = DamageModel(TABLE, PlannerConfig(routing_exponent=1.0)).multipliers(DamageInputs(mass))
    square = DamageModel(TABLE, PlannerConfig(routing_exponent=2.0)).multipliers(DamageInputs(mass))
    hot = TABLE.expert_index == 0  # layer 0, expert 0: mass 4
    assert np.all(flat == 1.0)
    assert np.allclose(linear[hot], 4.0) and np.allclose(square[hot], 16.0)


def test_residual_weight_scales_the_prompt_residual():
    residual = np.full(TABLE.num_blocks, 0.5)
    base = DamageModel(TABLE).damage()
    for weight in (0.0, 1.0, 2.0):
        got = DamageModel(TABLE, PlannerConfig(residual_weight=weight)).damage(DamageInputs(residual=residual))
        assert np.allclose(got, base * np.exp(weight * 0.5))


def lowered_planner(config: PlannerConfig) -> tuple[OnlinePlanner, int]:
    """An online planner at 4 bits everywhere, and the bytes that takes."""
    planner = OnlinePlanner(TABLE, DamageModel(TABLE, config), np.full(TABLE.num_blocks, 4), config)
    return planner, TABLE.bytes_of(planner.bits)


def test_dead_band_fraction_leaves_small_spare_bytes_unspent():
    for band, action in ((0.5, "hold"), (0.01, "spend")):
        planner, now = lowered_planner(PlannerConfig(dead_band_fraction=band, rebalance_fraction=0.0))
        assert planner.plan(int(now * 1.2)).action == action


def test_rebalance_min_gain_holds_a_plan_whose_gain_is_too_small():
    # a random start at the budget: a rebalance can cut damage, by some fraction
    bits = np.random.default_rng(0).integers(3, 9, TABLE.num_blocks)
    budget = TABLE.bytes_of(bits)
    gains = {}
    for gain in (0.0, 0.99):
        config = PlannerConfig(rebalance_min_gain=gain, rebalance_fraction=0.5)
        planner = OnlinePlanner(TABLE, DamageModel(TABLE, config), bits, config)
        gains[gain] = planner.plan(budget).action
    assert gains == {0.0: "rebalance", 0.99: "hold"}

