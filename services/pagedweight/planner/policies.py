"""Bit-width policies behind one interface, so the evaluation compares like with like.

Every policy answers `plan(budget, context) -> Plan`: a bit-width per block whose bytes
(planes + LUTs) fit the budget. `context` carries what an online planner would know
when the plan is made (routing statistics, prompt residuals); static policies ignore it.

- `pagedweight`: the full damage model (damage.py): sensitivity x routing multiplier x
  prompt residual, hot-expert floors, greedy per block.
  S is loss-calibrated per (layer, module) group when scales are given (loss_scale.py).
  Uniform guard: the greedy from 8 bits down is not optimal, so every plan is compared
  with uniform-plus-fill under the *same* damage table and the lower predicted damage
  wins (`Plan.action` "uniform-guard" when the guard chose): by construction a
  damage-model plan never predicts more damage than the uniform plan at equal bytes.
- `no-routing`, `no-residual`, `no-sensitivity`, `no-loss-scale`, `no-guard`: the same
  with one signal switched off (`no-sensitivity` drops S and its loss scales together).
- `uniform-fill`: uniform, then the bytes left under the budget spent greedily (one-bit
  raises by raw S removed per byte), what a careful uniform deployment would do.
- `uniform` (Any-Precision LLM): one bit-width for every block, the highest whose bytes
  fit; under pressure the whole model steps down one bit. A budget between two widths
  (e.g. 3.5 bits) leaves the difference unused, as that system would.
- `mxmoe` (MxMoE-style): a static mixed allocation solved once per budget from the
  offline sensitivity weighted by the calibration activation frequency of each expert
  (selections per token). What we approximate: MxMoE solves an ILP over accuracy and
  kernel speed with several quantisation schemes; we keep its accuracy term
  (frequency x sensitivity), our one scheme (APL), and solve it with the same greedy.
  It never sees online routing or prompts.
- `dpllm` (DP-LLM-style): one precision per (layer, module) group, chosen from an
  input-dependent error estimate. What we approximate: DP-LLM picks, per linear layer
  and per token at run time, between two adjacent precisions using a cheap estimate of
  the error on the current input. We take its layer granularity and its input
  dependence (the group's error is sum over its blocks of S_i(b) x the routing mass of
  the current traffic x the prompt residual: the expected error on the inputs now
  running) and choose once per plan, not per token; it does not tell experts apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.greedy import running, spend_bytes
from pagedweight.planner.planner import Plan, plan_bytes, plan_damage, solve
from pagedweight.planner.tables import BlockTable
from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS

POLICY_NAMES = ("pagedweight", "uniform", "uniform-fill", "mxmoe", "dpllm",
                "no-routing", "no-residual", "no-sensitivity", "no-loss-scale", "no-guard")
# Policies that read the loss-calibrated sensitivity (loss_scale.py) when scales are given;
# the others keep S in each block's own output space, as their methods define it.
LOSS_SCALED = ("pagedweight", "no-routing", "no-residual", "no-guard")


@dataclass
class PlanContext:
    """What the planner knows of the traffic when it plans (None: nothing beyond calibration)."""

    relative_mass: np.ndarray | None = None  # [L, E] routing mass / layer mean (moving average)
    residual: np.ndarray | None = None  # [N] or [N, 6]: predicted log(S_prompt / S)


class Policy(ABC):
    name: str

    def __init__(self, table: BlockTable, config: PlannerConfig = PlannerConfig()):
        self.table, self.config = table, config

    @abstractmethod
    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        """Bits for every block within `budget` bytes."""

    def prior_relative_mass(self, values: np.ndarray | None) -> np.ndarray | None:
        if values is None:
            return None
        return values / np.maximum(values.mean(axis=1, keepdims=True), 1e-12)


def uniform_fill(table: BlockTable, damage: np.ndarray, budget: int, config: PlannerConfig) -> np.ndarray:
    """The highest uniform width that fits, then the rest of the budget spent by `damage`."""
    fitting = [b for b in BIT_WIDTHS if table.uniform_bytes(b) <= budget]
    bits = np.full(table.num_blocks, max(fitting) if fitting else MIN_BITS, dtype=np.int64)
    spare = budget - table.bytes_of(bits)
    if spare > 0:
        ceilings = np.full(table.num_blocks, config.max_bits)
        bits = spend_bytes(damage, table.nbytes, bits, ceilings, spare).bits
    return bits


class PagedWeightPolicy(Policy):
    def __init__(self, table: BlockTable, config: PlannerConfig = PlannerConfig(), *,
                 use_sensitivity: bool = True, use_routing: bool = True,
                 use_residual: bool = True, guard: bool = True, name: str = "pagedweight"):
        super().__init__(table, config)
        self.name, self.guard = name, guard
        self.model = DamageModel(table, config, use_sensitivity, use_routing, use_residual)

    def inputs(self, context: PlanContext) -> DamageInputs:
        mass = context.relative_mass
        if mass is None:  # the moving average starts from the calibration run
            mass = self.prior_relative_mass(self.table.calib_mass)
        return DamageInputs(mass, context.residual)

    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        inputs = self.inputs(context)
        damage, floors = self.model.damage(inputs), self.model.floors(inputs)
        plan = solve(self.table.nbytes, damage, budget, floors, self.config)
        if not self.guard or plan.shortfall:
            return plan
        candidate = uniform_fill(self.table, damage, budget, self.config)
        candidate_damage = plan_damage(damage, candidate)
        if candidate_damage >= plan.damage:
            return plan
        return Plan(candidate, self.table.bytes_of(candidate), budget, candidate_damage,
                    floors_relaxed=bool(np.any(candidate < np.minimum(floors, self.config.max_bits))),
                    action="uniform-guard")


class UniformFillPolicy(Policy):
    name = "uniform-fill"

    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        bits = uniform_fill(self.table, self.table.sensitivity, budget, self.config)
        num_bytes = self.table.bytes_of(bits)
        return Plan(bits, num_bytes, budget, plan_damage(self.table.sensitivity, bits),
                    shortfall=max(num_bytes - budget, 0))


class UniformPolicy(Policy):
    name = "uniform"

    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        fitting = [b for b in BIT_WIDTHS if self.table.uniform_bytes(b) <= budget]
        width = max(fitting) if fitting else MIN_BITS
        bits = np.full(self.table.num_blocks, width, dtype=np.int64)
        num_bytes = self.table.bytes_of(bits)
        return Plan(bits, num_bytes, budget, plan_damage(self.table.sensitivity, bits),
                    shortfall=max(num_bytes - budget, 0))


class MxMoEPolicy(Policy):
    name = "mxmoe"

    def __init__(self, table: BlockTable, config: PlannerConfig = PlannerConfig()):
        super().__init__(table, config)
        frequency = table.calib_share if table.calib_share is not None else table.calib_mass
        rel = self.prior_relative_mass(frequency)
        weight = np.ones(table.num_blocks) if rel is None else rel.reshape(-1)[table.expert_index]
        self.damage = table.sensitivity * weight[:, None]
        self._plans: dict[int, Plan] = {}  # budget -> the plan solved once

    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        if budget not in self._plans:
            floors = np.full(self.table.num_blocks, self.config.min_bits)
            self._plans[budget] = solve(self.table.nbytes, self.damage, budget, floors, self.config)
        return self._plans[budget]


class DPLLMPolicy(Policy):
    name = "dpllm"

    def __init__(self, table: BlockTable, config: PlannerConfig = PlannerConfig()):
        super().__init__(table, config)
        modules = sorted({b.module for b in table.block_ids})
        group_key = table.layer * len(modules) + np.array([modules.index(b.module) for b in table.block_ids])
        _, self.group = np.unique(group_key, return_inverse=True)  # [N] block -> group
        self.num_groups = int(self.group.max()) + 1 if table.num_blocks else 0
        self.group_bytes = self._group_sum(table.nbytes)

    def _group_sum(self, values: np.ndarray) -> np.ndarray:
        out = np.zeros((self.num_groups, values.shape[1]), dtype=values.dtype)
        np.add.at(out, self.group, values)
        return out

    def plan(self, budget: int, context: PlanContext = PlanContext()) -> Plan:
        mass = context.relative_mass
        if mass is None:
            mass = self.prior_relative_mass(self.table.calib_mass)
        error = self.table.sensitivity.copy()
        if mass is not None:
            error *= mass.reshape(-1)[self.table.expert_index][:, None]
        if context.residual is not None:
            r = np.asarray(context.residual, dtype=np.float64)
            clip = self.config.residual_clip
            error *= np.exp(np.clip(r[:, None] if r.ndim == 1 else r, -clip, clip))
        error = running(np.minimum, error)
        floors = np.full(self.num_groups, self.config.min_bits)
        group_plan = solve(self.group_bytes, self._group_sum(error), budget, floors, self.config)
        bits = group_plan.bits[self.group]
        return Plan(bits, plan_bytes(self.table.nbytes, bits), budget, plan_damage(error, bits),
                    shortfall=group_plan.shortfall)


def make_policy(name: str, table: BlockTable, config: PlannerConfig = PlannerConfig(),
                scales=None) -> Policy:
    """`scales`: loss_scale.GroupScales, applied to the policies in LOSS_SCALED."""
    if scales is not None and name in LOSS_SCALED:
        from pagedweight.planner.loss_scale import apply_group_scales

        table = apply_group_scales(table, scales)
    if name == "pagedweight":
        return PagedWeightPolicy(table, config)
    if name == "no-routing":
        return PagedWeightPolicy(table, config, use_routing=False, name=name)
    if name == "no-residual":
        return PagedWeightPolicy(table, config, use_residual=False, name=name)
    if name == "no-sensitivity":
        return PagedWeightPolicy(table, config, use_sensitivity=False, name=name)
    if name == "no-loss-scale":
        return PagedWeightPolicy(table, config, name=name)
    if name == "no-guard":
        return PagedWeightPolicy(table, config, guard=False, name=name)
    if name == "uniform":
        return UniformPolicy(table, config)
    if name == "uniform-fill":
        return UniformFillPolicy(table, config)
    if name == "mxmoe":
        return MxMoEPolicy(table, config)
    if name == "dpllm":
        return DPLLMPolicy(table, config)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
