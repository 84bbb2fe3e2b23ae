"""The uniform guard: a damage-model plan never predicts more damage than uniform-plus-fill
at the same bytes under its own damage table; and the `uniform-fill` baseline."""

from __future__ import annotations

import numpy as np
import pytest

from pagedweight.planner.planner import plan_damage
from pagedweight.planner.policies import PlanContext, make_policy, uniform_fill
from pagedweight.planner.synthetic import synthetic_table

WIDTHS = (3.3, 3.5, 4, 4.5, 5.5, 6.5)


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_never_predicts_more_damage_than_uniform_fill(seed):
    table = synthetic_table(2, 4, 64, 96, 2, seed=seed)
    guarded, plain = make_policy("pagedweight", table), make_policy("no-guard", table)
    for width in WIDTHS:
        budget = table.uniform_bytes(width)
        plan = guarded.plan(budget)
        damage = guarded.model.damage(guarded.inputs(PlanContext()))
        fill = uniform_fill(table, damage, budget, guarded.config)
        assert plan.num_bytes <= budget
        assert plan.damage == pytest.approx(plan_damage(damage, plan.bits))
        assert plan.damage <= plan_damage(damage, fill) + 1e-15
        assert plan.damage <= plain.plan(budget).damage + 1e-15


def test_the_guard_changes_plans_where_the_greedy_loses():
    """The greedy from 8 bits down is not optimal: on these synthetic tables it loses to
    uniform-plus-fill at some budgets, and there the guard picks uniform-plus-fill."""
    chosen = 0
    for seed in range(12):
        table = synthetic_table(2, 4, 64, 96, 2, seed=seed)
        guarded, plain = make_policy("pagedweight", table), make_policy("no-guard", table)
        for width in WIDTHS:
            plan, greedy = guarded.plan(table.uniform_bytes(width)), plain.plan(table.uniform_bytes(width))
            if plan.action == "uniform-guard":
                chosen += 1
                assert plan.damage < greedy.damage
            else:
                assert np.array_equal(plan.bits, greedy.bits)
    assert chosen > 0


def test_uniform_fill_starts_uniform_and_spends_the_rest():
    table = synthetic_table(2, 4, 64, 96, 2, seed=3)
    for width in (3.5, 4.5, 7.5):
        budget = table.uniform_bytes(width)
        uniform = make_policy("uniform", table).plan(budget)
        fill = make_policy("uniform-fill", table).plan(budget)
        assert np.all(fill.bits >= uniform.bits) and fill.num_bytes <= budget
        assert fill.num_bytes > uniform.num_bytes  # half a width of bytes is not left unused
        # what is left cannot buy even the cheapest one-bit raise
        steps = table.nbytes[np.arange(table.num_blocks), np.minimum(fill.bits, 7) - 2] - \
            table.nbytes[np.arange(table.num_blocks), fill.bits - 3]
        assert budget - fill.num_bytes < steps[fill.bits < 8].min()
