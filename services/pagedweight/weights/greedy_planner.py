"""A minimal bit-width planner behind the interface the weight pager calls.

Used when no planner from services/planner is given (tests, synthetic benchmarks). The
quality-aware planner (issue 4) implements the same two calls with its damage model.

Greedy, one bit at a time: to free X bytes, repeatedly take the one-bit reduction with
the least added sensitivity per byte freed until at least X is freed; to spend Y bytes,
take the one-bit increases with the most sensitivity removed per byte while they fit.
Sensitivity S_i(b) comes from the paged artifact; without it, S_i(b) = weights * 4^-b
(the error of a uniform b-bit grid), which spreads bits evenly by size.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from pagedweight.format.apl_format import MAX_BITS, MIN_BITS, BlockId


class BitPlanner(Protocol):
    """What the weight pager needs from a planner. `bits` is the current plan
    (# block_id -> bits); both return only the blocks whose bits change."""

    def plan_free(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        ...

    def plan_spend(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        ...


class GreedyPlanner:
    def __init__(self, cost: dict[BlockId, dict[int, int]], sensitivity: dict[BlockId, dict[int, float]] | None = None,
                 min_bits: int = MIN_BITS, max_bits: int = MAX_BITS):
        self.cost = cost  # block_id -> {bits -> bytes}
        self.sensitivity = sensitivity or {bid: {b: c[MAX_BITS] * 4.0 ** -b for b in c} for bid, c in cost.items()}
        self.min_bits, self.max_bits = min_bits, max_bits

    def _step(self, bid: BlockId, frm: int, to: int) -> tuple[float, int]:
        """(damage change, bytes change) of moving one block from `frm` to `to` bits."""
        return (self.sensitivity[bid][to] - self.sensitivity[bid][frm], self.cost[bid][frm] - self.cost[bid][to])

    def plan_free(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        plan, freed, heap = dict(bits), 0, []
        for bid, b in bits.items():
            self._push_lower(heap, bid, b)
        while freed < num_bytes and heap:
            _, bid, b = heapq.heappop(heap)
            freed += self._step(bid, b, b - 1)[1]
            plan[bid] = b - 1
            self._push_lower(heap, bid, b - 1)
        return {bid: b for bid, b in plan.items() if b != bits[bid]}

    def _push_lower(self, heap, bid, b):
        if b > self.min_bits:
            damage, freed = self._step(bid, b, b - 1)
            heapq.heappush(heap, (damage / max(freed, 1), bid, b))

    def plan_spend(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        plan, left, heap = dict(bits), num_bytes, []
        for bid, b in bits.items():
            self._push_raise(heap, bid, b)
        while heap:
            _, bid, b = heapq.heappop(heap)
            cost = -self._step(bid, b, b + 1)[1]
            if cost > left:
                continue  # does not fit; a cheaper block further down may
            left -= cost
            plan[bid] = b + 1
            self._push_raise(heap, bid, b + 1)
        return {bid: b for bid, b in plan.items() if b != bits[bid]}

    def _push_raise(self, heap, bid, b):
        if b < self.max_bits:
            damage, freed = self._step(bid, b, b + 1)  # damage < 0, freed < 0
            heapq.heappush(heap, (damage / max(-freed, 1), bid, b))  # most removed per byte first
