"""One registered worker as the planner service keeps it: block table, policy, routing.

Built from a `RegisterRequest`; each `Plan` call first folds the routing window the
worker sent into the moving average (as the worker's own RoutingFeed does in process),
then asks the policy planner for a free or a spend plan. The same `PolicyPlanner` the
worker runs in process answers here, so a plan from the service and one from the
worker's fallback differ only by the routing each has seen.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass

import numpy as np

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BIT_WIDTHS, BlockId
from pagedweight.planner.routing_stats import RoutingStats
from pagedweight.planner.tables import BlockTable
from pagedweight.weights.policy_planner import PolicyPlanner


@dataclass(frozen=True)
class PlanResult:
    plan_id: int
    changes: dict[BlockId, int]  # block_id -> desired bits, changed blocks only
    bytes_delta: int  # negative frees
    damage: float  # the policy's predicted damage of its (unclipped) plan


class _TrackingPlanner(PolicyPlanner):
    """PolicyPlanner that keeps the policy's last Plan (for its predicted damage)."""

    last_damage = 0.0

    def _plan(self, bits, budget):
        self.num_plans += 1
        plan = self.policy.plan(max(budget, 0), self.context)
        self.last_damage = float(plan.damage)
        return plan.bits


def _expert_array(values, num_layers: int, num_experts: int, name: str) -> np.ndarray | None:
    if not values:
        return None
    if len(values) != num_layers * num_experts:
        raise UserError(f"{name}: expected {num_layers}x{num_experts} values, got {len(values)}")
    return np.asarray(values, dtype=np.float64).reshape(num_layers, num_experts)


class WorkerPlanState:
    def __init__(self, request):  # planner_pb2.RegisterRequest
        if not request.worker_id:
            raise UserError("worker_id must not be empty")
        if not request.blocks:
            raise UserError("a worker must register at least one block")
        L, E = request.num_layers, request.num_experts
        try:
            block_ids = [BlockId.parse(b.block_id) for b in request.blocks]
            nbytes = np.array([list(b.bytes_by_bits) for b in request.blocks], dtype=np.int64)
            sens = np.array([list(b.sensitivity) for b in request.blocks], dtype=np.float64)
            mass = _expert_array(request.calib_mass.values, L, E, "calib_mass")
            share = _expert_array(request.calib_share.values, L, E, "calib_share")
            table = BlockTable(block_ids, nbytes, sens, L, E, mass, share)
            self.routing = RoutingStats(L, E, request.top_k, prior_mass=mass)
        except ValueError as err:  # ragged arrays, bad keys, shapes (BlockTable's checks)
            raise UserError(f"bad block table: {err}") from None
        charged = {b: {w: int(n) for w, n in zip(BIT_WIDTHS, row)} for b, row in zip(block_ids, nbytes)}
        self.worker_id = request.worker_id
        self.policy_name = request.policy or "pagedweight"
        self.planner = _TrackingPlanner(self.policy_name, table, charged)
        self.registration_id = uuid.uuid4().hex
        self.block_ids = block_ids
        self._keys = {b.key(): b for b in block_ids}  # key -> BlockId
        self._plan_ids = itertools.count(1)

    def observe(self, window) -> None:
        """Fold a RoutingWindow (counts, mass [L*E], num_tokens [L]) into the average."""
        L, E = self.routing.num_layers, self.routing.num_experts
        if not window.num_tokens:
            return
        if len(window.counts) != L * E or len(window.mass) != L * E or len(window.num_tokens) != L:
            raise UserError(f"routing window must be [{L}x{E}] counts and mass and [{L}] tokens")
        counts = np.asarray(window.counts, dtype=np.float64).reshape(L, E)
        mass = np.asarray(window.mass, dtype=np.float64).reshape(L, E)
        for layer, num_tokens in enumerate(window.num_tokens):
            self.routing.observe_counts(layer, counts[layer], mass[layer], int(num_tokens))
        self.planner.context.relative_mass = self.routing.relative_mass()

    def plan(self, free: bool, num_bytes: int, bits_by_key: dict[str, int]) -> PlanResult:
        if num_bytes <= 0:
            raise UserError(f"num_bytes must be > 0, got {num_bytes}")
        bits = {}
        for key, b in bits_by_key.items():
            block = self._keys.get(key)
            if block is None:
                raise UserError(f"unknown block {key!r} (not in the registered table)")
            if b not in BIT_WIDTHS:
                raise UserError(f"block {key}: bits {b} not in {BIT_WIDTHS}")
            bits[block] = b
        if len(bits) != len(self.block_ids):
            raise UserError(f"bits must name every registered block ({len(self.block_ids)}), got {len(bits)}")
        changes = (self.planner.plan_free if free else self.planner.plan_spend)(bits, num_bytes)
        nbytes = self.planner.table.nbytes
        index = {b: i for i, b in enumerate(self.planner.table.block_ids)}
        delta = sum(int(nbytes[index[b], new - BIT_WIDTHS[0]] - nbytes[index[b], bits[b] - BIT_WIDTHS[0]])
                    for b, new in changes.items())
        return PlanResult(next(self._plan_ids), changes, delta, self.planner.last_damage)
