"""The budget sweep's budgets: from bf16 with the trace's whole KV down to only 3 bits fitting."""

from __future__ import annotations

from bench.budget_sweep import budget_points
from pagedweight.format.blocks import BIT_WIDTHS, block_bytes
from pagedweight.planner.sizing import fitting_uniform_bits


def sizes():
    experts = {b: 120 * block_bytes(512, 256, b) for b in BIT_WIDTHS}
    return {"fixed": 7_000_000, "kv_wanted": 3_000_000, "experts": experts,
            "experts_bf16": 120 * 512 * 256 * 2}


def test_the_sweep_runs_from_bf16_fitting_to_only_3_bits_fitting():
    s = sizes()
    budgets = budget_points(s, 5)
    assert len(budgets) == 5 and budgets == sorted(budgets, reverse=True)
    assert budgets[0] == s["fixed"] + s["experts_bf16"] + s["kv_wanted"]  # bf16 and all its KV: exactly
    widths = [fitting_uniform_bits(s["experts"], s["fixed"], s["kv_wanted"], b) for b in budgets]
    assert widths[0] == 8 and widths[-1] == 3
    assert all(a >= b for a, b in zip(widths, widths[1:]))
    # at the bottom, bf16 weights alone overflow what the budget leaves beside the fixed bytes
    assert budgets[-1] - s["fixed"] < s["experts_bf16"]

