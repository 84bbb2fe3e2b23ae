"""The budget sweep's budgets: from bf16 with the trace's whole KV down to only 3 bits fitting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.budget_sweep import BURST_PERIOD_S, BURST_S, budget_points, make_trace
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



def trace_args(trace, **kw):
    return SimpleNamespace(**{"trace": trace, "requests": 5, "prompt_len": 64, "duration_s": 600.0, "rate": 2.0,
                              "long_prompts": (4096, 16384), **kw})


def test_a_closed_trace_sends_every_request_at_once():
    assert make_trace(trace_args("closed")) == [(0.0, 64)] * 5


@pytest.mark.parametrize("trace", ["steady", "bursty", "long-context"])
def test_arrival_traces_keep_the_mean_rate_over_the_duration(trace):
    arrivals = make_trace(trace_args(trace))
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 600.0
    assert 0.9 * 1200 < len(arrivals) < 1.1 * 1200  # 2 a second for 600 s
    lengths = {n for _, n in arrivals}
    if trace == "long-context":
        assert min(lengths) >= 4096 and max(lengths) <= 16384 and len(lengths) > 100
    else:
        assert lengths == {64}
    assert make_trace(trace_args(trace)) == arrivals  # one seed


def test_a_bursty_trace_sends_3x_the_mean_in_its_bursts_and_a_third_between():
    arrivals = make_trace(trace_args("bursty", duration_s=2000.0))
    in_burst = sum(1 for t, _ in arrivals if t % BURST_PERIOD_S < BURST_S)
    burst_rate = in_burst / (2000.0 * BURST_S / BURST_PERIOD_S)
    calm_rate = (len(arrivals) - in_burst) / (2000.0 * (1 - BURST_S / BURST_PERIOD_S))
    assert 5.4 < burst_rate < 6.6 and 0.55 < calm_rate < 0.8, (burst_rate, calm_rate)
