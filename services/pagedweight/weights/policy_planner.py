"""The planner library (services/planner) behind the weight pager's two calls.

The pager asks `plan_free(bits, n)` (free at least n bytes) and `plan_spend(bits, n)`
(spend up to n bytes). A planner policy answers `plan(budget) -> bits for every block`.
We turn one into the other by budget: freeing n bytes is a plan for (bytes now - n),
spending is a plan for (bytes now + n). The policy's answer is then clipped to the
direction asked (a free never raises a block, a spend never lowers one), so a request for
KV bytes only ever lowers bits, and an offer only ever raises them.

Bytes are the arena's (whole pages, LUTs included: `PageTable.charged_bytes_table`), so
the planner sees what the KV cache will really get. `context` is the policy's view of the
traffic; the worker's `RoutingFeed` (services/worker/weights/routing_feed.py) refreshes its
routing moving average before every plan (hot experts keep more bits). Prompt residuals
are not fed yet (`context.residual` stays None).
"""

from __future__ import annotations

import numpy as np

from pagedweight.planner.policies import PlanContext, make_policy
from pagedweight.planner.tables import BlockTable
from pagedweight.format.apl_format import BIT_WIDTHS, BlockId


class PolicyPlanner:
    def __init__(self, policy_name: str, table: BlockTable, charged: dict[BlockId, dict[int, int]],
                 scales=None):  # loss_scale.GroupScales (`pagedweight plan-scales`) or None
        nbytes = np.array([[charged[b][w] for w in BIT_WIDTHS] for b in table.block_ids], dtype=np.int64)
        self.table = BlockTable(
            table.block_ids, nbytes, table.sensitivity, table.num_layers, table.num_experts,
            table.calib_mass, table.calib_share,
        )
        self.policy = make_policy(policy_name, self.table, scales=scales)
        self.context = PlanContext()  # routing statistics / prompt residuals, when fed
        self.num_plans = 0

    def _bits_array(self, bits: dict[BlockId, int]) -> np.ndarray:
        return np.array([bits[b] for b in self.table.block_ids], dtype=np.int64)

    def _plan(self, bits: dict[BlockId, int], budget: int) -> np.ndarray:
        self.num_plans += 1
        return self.policy.plan(max(budget, 0), self.context).bits

    def initial_bits(self, budget: int) -> dict[BlockId, int]:
        """# block_id -> bits: the policy's plan for `budget` bytes of expert weights."""
        bits = self.policy.plan(budget, self.context).bits
        return {b: int(v) for b, v in zip(self.table.block_ids, bits)}

    def plan_free(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        now = self._bits_array(bits)
        new = np.minimum(self._plan(bits, self.table.bytes_of(now) - num_bytes), now)
        return self._changes(now, new)

    def plan_spend(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        now = self._bits_array(bits)
        budget = self.table.bytes_of(now) + num_bytes
        new = np.maximum(self._plan(bits, budget), now)
        # A policy that reshuffles (lowers some blocks to raise others) overshoots once its
        # lowerings are clipped away: keep its raises, in table order, while they fit.
        rows = np.arange(len(now))
        cost = self.table.nbytes[rows, new - BIT_WIDTHS[0]] - self.table.nbytes[rows, now - BIT_WIDTHS[0]]
        over = np.cumsum(cost) > num_bytes
        new = np.where(over, now, new)
        return self._changes(now, new)

    def _changes(self, now: np.ndarray, new: np.ndarray) -> dict[BlockId, int]:
        return {b: int(n) for b, o, n in zip(self.table.block_ids, now, new) if n != o}
