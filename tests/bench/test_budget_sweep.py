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


def test_minimum_blocks_are_the_fewest_that_can_free_the_bytes():
    import numpy as np

    from bench.budget_sweep import MovesAgainstMinimum

    class Planner:  # the wrapper needs submit/poll and the registered table's bytes
        submit = poll = staticmethod(lambda *a: None)

        class table:
            nbytes = np.array([[100, 200, 300, 400, 500, 600]] * 2 + [[10, 20, 30, 40, 50, 60]], dtype=np.int64)

    counter = MovesAgainstMinimum(Planner())
    bits = np.array([8, 5, 8])
    # bytes above 3 bits: 500, 200, 50
    assert counter.minimum(bits, 1) == 1
    assert counter.minimum(bits, 500) == 1
    assert counter.minimum(bits, 501) == 2
    assert counter.minimum(bits, 700) == 2
    assert counter.minimum(bits, 701) == 3
    assert counter.minimum(bits, 10**6) == 3  # more than all of them: every block
