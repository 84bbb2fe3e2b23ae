"""Damage model, routing moving average, block tables and the policies behind one interface."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.damage import DamageInputs, DamageModel, block_numel
from pagedweight.planner.policies import POLICY_NAMES, PlanContext, make_policy
from pagedweight.planner.routing_stats import RoutingStats
from pagedweight.planner.tables import BlockTable
from pagedweight.format.apl_format import BlockId, block_bytes
from tests.planner.strategies import SHAPES, random_table


def test_block_table_bytes_come_from_the_format_definition():
    ids = [BlockId(0, 0, "gate_up"), BlockId(0, 0, "down"), BlockId(1, 1, "gate_up")]
    shapes = [(64, 32), (32, 64), (512, 64)]
    table = BlockTable.from_shapes(ids, shapes, np.ones((3, 6)), 2, 2)
    bits = np.array([3, 8, 5])
    assert table.bytes_of(bits) == sum(block_bytes(r, c, int(b)) for (r, c), b in zip(shapes, bits))
    low, high = table.uniform_bytes(3), table.uniform_bytes(4)
    assert low == sum(block_bytes(r, c, 3) for r, c in shapes)
    assert table.uniform_bytes(3.5) == round((low + high) / 2)
    assert table.bits_from_map(table.bits_map(bits)).tolist() == bits.tolist()


def test_block_numel_recovers_rows_times_cols():
    for rows, cols in SHAPES + [(2816, 2048), (2048, 1408)]:
        nbytes = np.array([[block_bytes(rows, cols, b) for b in range(3, 9)]])
        assert block_numel(nbytes)[0] == rows * cols


def test_block_table_rejects_bad_shapes_and_clips_nonmonotone_sensitivity():
    ids = [BlockId(0, 0, "gate_up")]
    with pytest.raises(ValueError, match="must be"):
        BlockTable.from_shapes(ids, [(32, 32)], np.ones((1, 5)), 1, 1)
    table = BlockTable.from_shapes(ids, [(32, 32)], np.array([[4.0, 2.0, 3.0, 1.0, 1.5, 0.5]]), 1, 1)
    assert table.sensitivity.tolist() == [[4.0, 2.0, 2.0, 1.0, 1.0, 0.5]]
    with pytest.raises(ValueError, match="outside"):
        BlockTable.from_shapes([BlockId(1, 0, "down")], [(32, 32)], np.ones((1, 6)), 1, 1)


def test_routing_moving_average_has_the_configured_half_life():
    stats = RoutingStats(1, 4, top_k=1, half_life_tokens=100, prior_mass=np.full((1, 4), 0.25))
    ids = torch.zeros(100, 1, dtype=torch.int64)  # every token to expert 0, gate weight 1
    stats.observe(0, ids, torch.ones(100, 1, dtype=torch.bfloat16))
    assert stats.mass[0].tolist() == pytest.approx([0.625, 0.125, 0.125, 0.125])  # half-way to [1,0,0,0]
    assert stats.relative_mass()[0, 0] == pytest.approx(2.5)
    # the same tokens in ten steps age the history the same
    split = RoutingStats(1, 4, top_k=1, half_life_tokens=100, prior_mass=np.full((1, 4), 0.25))
    for _ in range(10):
        split.observe_counts(0, np.array([10, 0, 0, 0]), np.array([10.0, 0, 0, 0]), 10)
    assert np.allclose(split.mass, stats.mass)


def test_routing_multiplier_floor_and_residual_are_clipped():
    table = random_table(1, 4, 2)
    config = PlannerConfig(min_multiplier=0.1, max_multiplier=4.0, hot_floors=((2.0, 5),), residual_clip=1.0)
    model = DamageModel(table, config)
    mass = np.array([[0.0, 1.0, 2.0, 10.0]])
    mult = model.multipliers(DamageInputs(mass))
    assert mult.reshape(4, 2)[:, 0].tolist() == [0.1, 1.0, 2.0, 4.0]
    assert model.floors(DamageInputs(mass)).reshape(4, 2)[:, 0].tolist() == [3, 3, 5, 5]
    residual = np.zeros(table.num_blocks)
    residual[0] = 50.0  # clipped to 1.0
    damage = model.damage(DamageInputs(np.ones((1, 4)), residual))
    assert damage[0] == pytest.approx(table.sensitivity[0] * np.e)
    assert np.allclose(damage[1:], table.sensitivity[1:])
    ablated = DamageModel(table, config, use_routing=False, use_residual=False)
    assert np.allclose(ablated.damage(DamageInputs(mass, residual)), table.sensitivity)
    assert np.all(ablated.floors(DamageInputs(mass)) == 3)


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("width", [3, 3.5, 4, 5])
def test_every_policy_fits_its_budget(name, width):
    table = random_table(3, 6, 5)
    budget = table.uniform_bytes(width)
    plan = make_policy(name, table).plan(budget)
    assert plan.num_bytes == table.bytes_of(plan.bits) <= budget
    assert np.all((plan.bits >= 3) & (plan.bits <= 8))


def test_uniform_and_dpllm_granularity():
    table = random_table(3, 6, 5)
    budget = table.uniform_bytes(4.6)
    uniform = make_policy("uniform", table).plan(budget)
    assert set(uniform.bits.tolist()) == {4}
    dpllm = make_policy("dpllm", table).plan(budget).bits
    for layer in range(3):
        for module in ("gate_up", "down"):
            group = [i for i, b in enumerate(table.block_ids) if b.layer == layer and b.module == module]
            assert len(set(dpllm[group].tolist())) == 1


def test_context_moves_pagedweight_but_not_mxmoe():
    table = random_table(2, 6, 9)
    budget = table.uniform_bytes(4.5)
    hot = np.full((2, 6), 0.2)
    hot[:, 5] = 5.0
    context = PlanContext(relative_mass=hot)
    paged = make_policy("pagedweight", table)
    hot_blocks = np.array([b.expert == 5 for b in table.block_ids])
    assert paged.plan(budget, context).bits[hot_blocks].sum() > paged.plan(budget).bits[hot_blocks].sum()
    mxmoe = make_policy("mxmoe", table)
    assert np.array_equal(mxmoe.plan(budget, context).bits, mxmoe.plan(budget).bits)
    no_routing = make_policy("no-routing", table)
    assert np.array_equal(no_routing.plan(budget, context).bits, no_routing.plan(budget).bits)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="pagedweight"):
        make_policy("fp4", random_table(1, 1, 0))
