"""Budgets in mean plane bits: the table whose bytes are the bit planes alone."""

from __future__ import annotations

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, BlockId, block_bytes
from pagedweight.planner.policies import make_policy
from pagedweight.planner.tables import BlockTable

SHAPES = [(64, 32), (32, 64), (128, 32), (32, 128)]


def table() -> BlockTable:
    ids = [BlockId(0, e, m) for e in range(2) for m in ("gate_up", "down")]
    sens = np.array([[4.0 ** -b * (i + 1) for b in BIT_WIDTHS] for i in range(len(ids))])
    return BlockTable.from_shapes(ids, SHAPES, sens, num_layers=1, num_experts=2)


def test_planes_only_drops_the_luts_and_keeps_the_rest():
    full = table()
    planes = full.planes_only(SHAPES)
    for i, (r, c) in enumerate(SHAPES):
        assert planes.nbytes[i].tolist() == [b * r * c // 8 for b in BIT_WIDTHS]
        assert full.nbytes[i].tolist() == [block_bytes(r, c, b) for b in BIT_WIDTHS]
    assert np.array_equal(planes.sensitivity, full.sensitivity)
    assert planes.block_ids == full.block_ids and full.nbytes[0, 0] > planes.nbytes[0, 0]


def test_a_plane_budget_bounds_the_mean_plane_bits():
    planes = table().planes_only(SHAPES)
    weights = np.array([r * c for r, c in SHAPES])
    for bits in (3.0, 3.5, 4.0, 5.0):
        budget = int(bits * weights.sum() // 8)
        plan = make_policy("pagedweight", planes).plan(budget)
        mean = (plan.bits * weights).sum() / weights.sum()
        assert mean <= bits + 1e-9
        assert mean > bits - 1.0  # the budget is spent, not left: within one width
    uniform = make_policy("uniform", planes).plan(int(3.5 * weights.sum() // 8))
    assert set(uniform.bits.tolist()) == {3}  # 3.5 bits: the widest single width that fits


def test_planes_only_checks_the_shapes():
    import pytest

    with pytest.raises(ValueError):
        table().planes_only(SHAPES[:2])
