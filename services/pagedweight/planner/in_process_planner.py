"""The planner library behind the `BitPlanner` protocol, in the worker's own process.

A request carries KV pressure: bytes needed (free them) or bytes free (spend them), i.e.
a budget of (bytes now - n) or (bytes now + n).
- The damage-model policies (`pagedweight` and its ablations) plan with the planner's
  `OnlinePlanner` from the worker's current bits: it frees exactly the excess, spends
  spare bytes beyond its dead band and rebalances only for a real gain. When bytes move
  is the broker's one time hysteresis (BrokerConfig.calm_steps).
- The static baselines (uniform, mxmoe, dpllm) answer `plan(budget)` from scratch, as
  their methods do.
Either answer is clipped to the direction asked (a free never raises a block, a spend
never lowers one; a spend keeps its raises, in table order, while they fit), so a
request for KV bytes only ever lowers bits and an offer only raises.

Routing arrives as a snapshot with each request and goes into the planner's own
moving average (planner/routing_stats.py); the policy sees its relative mass (hot
experts keep more bits). The prompts in flight arrive with each request too (a
`PromptMix`, its residual already predicted by the worker from the artifact's heads):
the request's residual replaces the context's, so prompts that left drop out with the
next request, and a request without one (no prompts in flight) clears it.

`move_cost` > 0: a free request for the damage-model policies is answered by
lowering fewer blocks further (planner/fewer_moves.py), each moved block costing
move_cost times the median damage of one bit, and a spend by raising whole blocks to the
ceiling within the bytes the greedy spent (best damage saved per byte first; the greedy's
answer when none fits); 0 keeps the one-bit greedy both ways.

The operator's dial (planner/dial.py) bounds both directions: a free never goes below the
quality floor's bytes, and a spend is held while the reported latency is above target.
`num_limited` counts the requests it cut or held, by reason.

Answers are immediate (ready at the next `poll`), but nothing in the pager relies on it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS, BlockId
from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.dial import OperatorDial
from pagedweight.planner.fewer_moves import free_with_fewer_moves, move_cost_scale, raise_whole
from pagedweight.planner.messages import SPEND, PlannerRegistration, PlanRequest, PlanResponse
from pagedweight.planner.planner import OnlinePlanner
from pagedweight.planner.policies import PagedWeightPolicy, PlanContext, make_policy
from pagedweight.planner.routing_stats import RoutingStats
from pagedweight.planner.tables import BlockTable


class InProcessPlanner:
    def __init__(self, policy_name: str, scales=None,  # loss_scale.GroupScales or None
                 config: PlannerConfig = PlannerConfig(), move_cost: float = 0.0):
        if move_cost < 0:
            raise ValueError(f"move_cost must be >= 0, got {move_cost}")
        self.policy_name, self.scales, self.config = policy_name, scales, config
        self.move_cost = move_cost  # per moved block on frees, in medians of one bit's damage (> 0: whole raises too)
        self.dial = OperatorDial()  # replaced whole, at any time, by the service or the worker
        self.num_limited = {"floor": 0, "latency": 0}  # requests the dial cut or held, by reason
        self.table: BlockTable | None = None
        self.num_plans = 0
        self._ready: deque[PlanResponse] = deque()

    def register(self, registration: PlannerRegistration) -> None:
        r = registration
        self.table = BlockTable(r.block_ids(), r.nbytes, r.sensitivity, r.num_layers, r.num_experts,
                                r.calib_mass, r.calib_share)
        self.policy = make_policy(self.policy_name, self.table, self.config, scales=self.scales)
        self.stats = RoutingStats(r.num_layers, r.num_experts, r.top_k, self.config.routing_half_life_tokens,
                                  prior_mass=r.calib_mass)
        self.context = PlanContext()  # the calibration prior until routing arrives
        self.online: OnlinePlanner | None = None  # made at the first request (from its bits)

    def initial_bits(self, budget: int) -> np.ndarray:
        return self.policy.plan(budget, self.context).bits.copy()

    def submit(self, request: PlanRequest) -> None:
        if self.table is None:
            raise RuntimeError("InProcessPlanner: submit before register")
        if request.routing is not None:
            for layer, num_tokens in enumerate(request.routing.num_tokens.tolist()):
                self.stats.observe_counts(layer, request.routing.counts[layer], request.routing.mass[layer],
                                          int(num_tokens))
            self.context.relative_mass = self.stats.relative_mass()
        self.observe_prompts(request)
        self._ready.append(self._answer(request))

    def observe_prompts(self, request: PlanRequest) -> None:
        """The request's prompts in flight become the context's residual (None: no prompts)."""
        residual = request.prompts.residual if request.prompts is not None else None
        if residual is not None and len(residual) != self.table.num_blocks:
            raise ValueError(f"prompt residual has {len(residual)} values for {self.table.num_blocks} blocks")
        self.context.residual = residual

    def poll(self) -> PlanResponse | None:
        return self._ready.popleft() if self._ready else None

    def _answer(self, request: PlanRequest) -> PlanResponse:
        now = np.asarray(request.bits, dtype=np.int64)
        rows = np.arange(len(now))
        pressure, dial = request.pressure, self.dial
        if pressure.direction == SPEND and dial.holds_spend(request.inter_token_s):
            self.num_limited["latency"] += 1
            return self._hold(request, now)
        needed = pressure.bytes_needed
        if pressure.direction != SPEND and dial.min_mean_bits:
            above_floor = max(self.table.bytes_of(now) - dial.floor_bytes(self.table), 0)
            if needed > above_floor:
                self.num_limited["floor"] += 1
                needed = above_floor
            if needed == 0:
                return self._hold(request, now)
        budget = self.table.bytes_of(now) + (pressure.bytes_free if pressure.direction == SPEND else -needed)
        plan = self._plan(now, max(budget, 0))
        if pressure.direction == SPEND:
            new = np.maximum(plan.bits, now)
            # A policy that reshuffles (lowers some blocks to raise others) overshoots once its
            # lowerings are clipped away: keep its raises, in table order, while they fit.
            cost = self.table.nbytes[rows, new - MIN_BITS] - self.table.nbytes[rows, now - MIN_BITS]
            new = np.where(np.cumsum(cost) > pressure.bytes_free, now, new)
            if self.move_cost > 0 and isinstance(self.policy, PagedWeightPolicy) and (new != now).any():
                new = self._whole_raises(now, new)
        else:
            new = np.minimum(plan.bits, now)
            if self.move_cost > 0 and isinstance(self.policy, PagedWeightPolicy):
                new = self._fewer_moves(now, new, needed)
            if dial.min_mean_bits:
                new = self._above_floor(now, new, dial.floor_bytes(self.table))
        changed = np.flatnonzero(new != now)
        delta = int((self.table.nbytes[changed, new[changed] - MIN_BITS]
                     - self.table.nbytes[changed, now[changed] - MIN_BITS]).sum())
        return PlanResponse(request.request_id, self.num_plans, changed, new[changed], delta, plan.damage)

    def _above_floor(self, now: np.ndarray, new: np.ndarray, floor: int) -> np.ndarray:
        """A free's completing step may over-shoot the floor: put back the last lowered blocks
        (table order) until the plan holds the floor's bytes again."""
        for i in np.flatnonzero(new != now)[::-1]:
            if self.table.bytes_of(new) >= floor:
                break
            new[i] = now[i]
        if self.online is not None:
            self.online.bits = new.copy()
        return new

    def _hold(self, request: PlanRequest, now: np.ndarray) -> PlanResponse:
        """No change: the answer to a request the dial holds."""
        damage = self.policy.model.damage(self.policy.inputs(self.context)) \
            if isinstance(self.policy, PagedWeightPolicy) else self.table.sensitivity
        none = np.zeros(0, dtype=np.int64)
        return PlanResponse(request.request_id, self.num_plans, none, none, 0,
                            float(damage[np.arange(len(now)), now - MIN_BITS].sum()))

    def _fewer_moves(self, now: np.ndarray, greedy: np.ndarray, needed: int) -> np.ndarray:
        """Free what the greedy freed (at least `needed`) with fewer blocks moved."""
        inputs = self.policy.inputs(self.context)
        damage, floors = self.policy.model.damage(inputs), np.minimum(self.policy.model.floors(inputs), now)
        target = max(needed, self.table.bytes_of(now) - self.table.bytes_of(greedy))
        scale = move_cost_scale(damage, now, floors)
        fewer = free_with_fewer_moves(damage, self.table.nbytes, now, floors, target, self.move_cost * scale)
        if fewer is None or np.count_nonzero(fewer != now) >= np.count_nonzero(greedy != now):
            return greedy
        if self.online is not None:
            self.online.bits = fewer.copy()
        return fewer

    def _whole_raises(self, now: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """Spend what the greedy spent on whole raises (each block to the ceiling at once);
        the greedy's own answer when not one whole raise fits in those bytes."""
        rows = np.arange(len(now))
        spent = int((self.table.nbytes[rows, greedy - MIN_BITS] - self.table.nbytes[rows, now - MIN_BITS]).sum())
        damage = self.policy.model.damage(self.policy.inputs(self.context))
        ceilings = np.full(len(now), self.config.max_bits)
        whole = raise_whole(damage, self.table.nbytes, now, ceilings, spent)
        if whole is None:
            return greedy
        if self.online is not None:
            self.online.bits = whole.copy()
        return whole

    def _plan(self, now: np.ndarray, budget: int):
        self.num_plans += 1
        if not isinstance(self.policy, PagedWeightPolicy):
            return self.policy.plan(budget, self.context)
        if self.online is None:
            self.online = OnlinePlanner(self.table, self.policy.model, now, self.config)
        self.online.bits = now.copy()  # the worker's truth: raises it cancelled or dropped count
        return self.online.plan(budget, self.policy.inputs(self.context))


def page_table_registration(charged: dict[BlockId, dict[int, int]], num_layers: int | None = None,
                            num_experts: int | None = None, top_k: int = 1,
                            sensitivity: np.ndarray | None = None,
                            calib_mass: np.ndarray | None = None,
                            calib_share: np.ndarray | None = None) -> PlannerRegistration:
    """A registration in the page table's block order. `charged`: PageTable.charged_bytes_table().

    Layer and expert counts default to those the block ids span (synthetic benchmarks).
    Without a sensitivity table, S_i(b) = 8-bit bytes * 4^-b (the error of a uniform
    b-bit grid scaled by size), which spreads bits evenly by size."""
    block_ids = list(charged)
    num_layers = num_layers or 1 + max(b.layer for b in block_ids)
    num_experts = num_experts or 1 + max(b.expert for b in block_ids)
    nbytes = np.array([[charged[b][w] for w in BIT_WIDTHS] for b in block_ids], dtype=np.int64)
    nbytes = nbytes.reshape(len(block_ids), len(BIT_WIDTHS))
    if sensitivity is None:
        widths = np.array(BIT_WIDTHS, dtype=np.float64)
        sensitivity = nbytes[:, -1:].astype(np.float64) * np.power(4.0, -widths)[None, :]
    return PlannerRegistration(tuple(b.key() for b in block_ids), nbytes, np.asarray(sensitivity, dtype=np.float64),
                               num_layers, num_experts, top_k, calib_mass, calib_share)
