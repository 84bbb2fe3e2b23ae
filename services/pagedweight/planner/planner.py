"""Plans: a static solve for a budget, and the online planner that moves a plan with hysteresis.

`solve` (static): start every block at its ceiling and free bytes greedily down to the
budget. Soft floors (hot experts) hold first; only if the budget cannot be met above
them are they relaxed to config.min_bits (reported as `floors_relaxed`).

`OnlinePlanner.plan(budget, inputs)` (one call per planning tick), in this order:
1. Over budget: free exactly the excess (the budget is never exceeded).
2. Spare bytes beyond the dead band (`dead_band_fraction` of the budget): spend them.
3. Otherwise (inside the dead band) try one rebalance: spend `rebalance_fraction` of the
   budget on the best increases, free the excess from the other blocks, and keep the
   result only if it cuts predicted damage by at least `rebalance_min_gain`.
Under a steady load the damage table and budget stop changing, so steps 1 and 2 have
nothing to do after the first plan, and every accepted rebalance lowers damage by a
fixed fraction, which can only happen finitely often: the plan converges and then holds.

When to plan is not decided here: on the serving path the memory broker gives KV bytes
back only after `BrokerConfig.calm_steps` calm steps, the one time hysteresis. A per-block
residence time here (a moved block may not move back for n plans) was removed: with the
broker's gating it made an offer find nothing to raise, the pager then remembers that
offer as refused, and the bits never came back (tests/test_runtime.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.greedy import free_bytes, spend_bytes
from pagedweight.planner.tables import BlockTable
from pagedweight.format.blocks import MIN_BITS


@dataclass
class Plan:
    bits: np.ndarray  # int64 [N], table order  # block index -> bits
    num_bytes: int  # bytes of the plan (planes + LUTs)
    budget: int
    damage: float  # predicted damage under the policy's own damage model
    floors_relaxed: bool = False  # hot-expert floors were broken to meet the budget
    shortfall: int = 0  # > 0: even every block at min_bits exceeds the budget by this much
    action: str = "solve"  # solve | free | spend | rebalance | hold


def plan_damage(damage: np.ndarray, bits: np.ndarray) -> float:
    return float(damage[np.arange(len(bits)), bits - MIN_BITS].sum())


def plan_bytes(nbytes: np.ndarray, bits: np.ndarray) -> int:
    return int(nbytes[np.arange(len(bits)), bits - MIN_BITS].sum())


def solve(nbytes: np.ndarray, damage: np.ndarray, budget: int, floors: np.ndarray,
          config: PlannerConfig = PlannerConfig()) -> Plan:
    """The least-damage plan within `budget` bytes, greedily from the ceiling down.

    nbytes and damage are [N, 6] per item: blocks, or groups of blocks (dpllm).
    """
    bits = np.full(len(nbytes), config.max_bits, dtype=np.int64)
    floors = np.minimum(floors, config.max_bits)
    bits, relaxed, shortfall = _free_to_budget(nbytes, damage, bits, budget, floors, config)
    return Plan(bits, plan_bytes(nbytes, bits), budget, plan_damage(damage, bits), relaxed, shortfall)


def _free_to_budget(nbytes, damage, bits, budget, floors, config):
    """Free down to `budget`; relax the soft floors only if they make it impossible."""
    excess = plan_bytes(nbytes, bits) - budget
    if excess <= 0:
        return bits, False, 0
    result = free_bytes(damage, nbytes, bits, floors, excess)
    if not result.shortfall:
        return result.bits, False, 0
    hard = np.full_like(floors, config.min_bits)
    result = free_bytes(damage, nbytes, result.bits, hard, result.shortfall)
    return result.bits, True, result.shortfall


_REBALANCE_TRIES = 6  # raises of fraction x budget, then halved: down to 1/32 of it


class OnlinePlanner:
    """Holds the committed plan and moves it toward each new budget, with hysteresis."""

    def __init__(self, table: BlockTable, model: DamageModel, initial_bits: np.ndarray,
                 config: PlannerConfig = PlannerConfig()):
        self.table, self.model, self.config = table, model, config
        self.bits = np.asarray(initial_bits, dtype=np.int64).copy()
        self.num_plans = 0

    def plan(self, budget: int, inputs: DamageInputs = DamageInputs()) -> Plan:
        self.num_plans += 1
        damage = self.model.damage(inputs)
        floors = self.model.floors(inputs)
        current = self.table.bytes_of(self.bits)
        relaxed, shortfall, action = False, 0, "hold"
        if current > budget:
            new_bits, relaxed, shortfall = _free_to_budget(self.table.nbytes, damage, self.bits, budget,
                                                           floors, self.config)
            action = "free"
        elif budget - current >= self.config.dead_band_fraction * budget:
            ceilings = np.full(self.table.num_blocks, self.config.max_bits)
            new_bits = spend_bytes(damage, self.table.nbytes, self.bits, ceilings, budget - current).bits
            action = "spend"
        else:
            new_bits = self._rebalance(damage, budget, floors)
            action = "rebalance" if not np.array_equal(new_bits, self.bits) else "hold"
        self.bits = new_bits
        return Plan(self.bits.copy(), self.table.bytes_of(self.bits), budget,
                    plan_damage(damage, self.bits), relaxed, shortfall, action)

    def _rebalance(self, damage, budget, floors) -> np.ndarray:
        """Raise the most valuable blocks by up to rebalance_fraction of the budget, then free
        the excess from the others. A raise the others cannot pay for (every block raised,
        say) is halved and tried again, so a large fraction still finds the moves a small
        one would."""
        extra = int(self.config.rebalance_fraction * budget)
        for _ in range(_REBALANCE_TRIES):
            bits = self._rebalance_by(damage, budget, floors, extra)
            if bits is not None:
                return bits
            extra //= 2
        return self.bits

    def _rebalance_by(self, damage, budget, floors, extra: int) -> np.ndarray | None:
        """The rebalance that raises by `extra` bytes; None when the excess cannot be freed."""
        ceilings = np.full(self.table.num_blocks, self.config.max_bits)
        raised = spend_bytes(damage, self.table.nbytes, self.bits, ceilings, extra).bits
        # blocks just raised stay where they are while we free
        keep = raised > self.bits
        lower_floors = np.where(keep, raised, np.minimum(floors, raised))
        excess = self.table.bytes_of(raised) - budget
        if excess <= 0:
            return raised
        result = free_bytes(damage, self.table.nbytes, raised, lower_floors, excess)
        if result.shortfall:
            return None
        before, after = plan_damage(damage, self.bits), plan_damage(damage, result.bits)
        return result.bits if after <= (1 - self.config.rebalance_min_gain) * before else self.bits
