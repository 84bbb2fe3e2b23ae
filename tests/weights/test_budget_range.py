"""Every memory budget either runs or says how much it needs.

Budgets just below what fits used to crash in the page mover (a CPU-only block was
raised part of the way, to 1 or 2 bits, which have no LUT) or in `load_all`
(`BudgetExceeded`: the policy cannot plan below 3 bits, so its plan over-committed the
arena). The invariant: committed bits are 0 or a bit-width, and start-up refuses a budget
that cannot hold every block at its floor plus the KV room, naming the least that does.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedweight.common.errors import UserError
from pagedweight.cli.load_bench import LoadSpec, run_load
from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.runtime import RuntimeConfig, build_runtime

MiB = 1 << 20
NEED = re.compile(r"need at least (\d+) bytes")


def least_budget(paged_dir, policy: str) -> int:
    """The minimum start-up states for a budget just above the dense weights and workspace."""
    with pytest.raises(UserError) as err:
        build_runtime(paged_dir, RuntimeConfig(12 * MiB + 1, policy))
    found = NEED.search(str(err.value))
    assert found, str(err.value)
    return int(found.group(1))


def check_budget(paged_dir, budget: int, policy: str, need: int) -> None:
    try:
        runtime = build_runtime(paged_dir, RuntimeConfig(budget, policy))
    except UserError as err:
        assert budget < need, f"budget {budget} >= the stated minimum {need} was refused: {err}"
        assert f"need at least {need} bytes" in str(err) or "does not hold the dense weights" in str(err)
        return
    try:
        assert budget >= need, f"budget {budget} below the stated minimum {need} was accepted"
        assert all(e.committed_bits in BIT_WIDTHS for e in runtime.table.entries.values())
        result = run_load(runtime, LoadSpec(num_requests=6, concurrency=6, prompt_len=8, max_tokens=4,
                                            max_drain_steps=50))
        assert result["requests_completed"] == 6 and result["requests_failed"] == 0
        assert result["peak_reserved_bytes"] <= budget
        assert all(e.committed_bits in BIT_WIDTHS for e in runtime.table.entries.values())
    finally:
        runtime.close()


@pytest.mark.parametrize("policy", ["pagedweight", "static-3"])
def test_the_stated_minimum_is_exact(paged_micro_dir, policy):
    need = least_budget(paged_micro_dir, policy)
    check_budget(paged_micro_dir, need - 1, policy, need)
    check_budget(paged_micro_dir, need, policy, need)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_budget_runs_or_names_the_minimum(paged_micro_dir, data):
    policy = data.draw(st.sampled_from(["pagedweight", "uniform", "static-3", "static-4"]), label="policy")
    need = least_budget(paged_micro_dir, policy)
    budget = data.draw(st.one_of(st.integers(1, 24 * MiB),  # the whole range ...
                                 st.integers(need - 2 * MiB, need + MiB)),  # ... and around the edge
                       label="budget")
    check_budget(paged_micro_dir, budget, policy, need)
