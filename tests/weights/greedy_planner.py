"""A test double behind the `BitPlanner` protocol: a textbook heap greedy, no damage model.

The pager's tests need a planner whose choices are easy to predict and independent of
the planner library, so a pager bug cannot hide behind a planner change. Serving uses
planner/in_process_planner.py (the planner library's policies); nothing ships this.

To free X bytes, repeatedly take the one-bit reduction with the least added sensitivity
per byte freed until at least X is freed; to spend Y bytes, take the one-bit increases
with the most sensitivity removed per byte while they fit. Without a sensitivity table
S_i(b) = bytes at 8 bits * 4^-b, which spreads bits evenly by size.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

from pagedweight.format.blocks import MAX_BITS, MIN_BITS, BlockId
from pagedweight.planner.messages import SPEND, PlannerRegistration, PlanRequest, PlanResponse
from pagedweight.planner.in_process_planner import page_table_registration


class GreedyPlanner:
    def __init__(self, cost: dict[BlockId, dict[int, int]], sensitivity: dict[BlockId, dict[int, float]] | None = None,
                 min_bits: int = MIN_BITS, max_bits: int = MAX_BITS, answer_after_polls: int = 0):
        """`cost`: PageTable.charged_bytes_table() (registered in its order).
        `answer_after_polls`: a response becomes ready only after this many empty polls,
        as a remote planner's would."""
        self.cost = cost  # block_id -> {bits -> bytes}
        self.sensitivity = sensitivity or {bid: {b: c[MAX_BITS] * 4.0 ** -b for b in c} for bid, c in cost.items()}
        self.min_bits, self.max_bits = min_bits, max_bits
        self.answer_after_polls = answer_after_polls
        self.requests: list[PlanRequest] = []
        self._queue: deque[list] = deque()  # [polls left, response]
        self.register(page_table_registration(cost))

    def register(self, registration: PlannerRegistration) -> None:
        self.block_ids = registration.block_ids()

    def initial_bits(self, budget: int) -> np.ndarray:
        bits = {bid: self.max_bits for bid in self.block_ids}
        excess = sum(self.cost[b][self.max_bits] for b in self.block_ids) - budget
        bits.update(self.plan_free(bits, excess) if excess > 0 else {})
        return np.array([bits[b] for b in self.block_ids], dtype=np.int64)

    def submit(self, request: PlanRequest) -> None:
        self.requests.append(request)
        bits = {bid: int(b) for bid, b in zip(self.block_ids, request.bits)}
        if request.pressure.direction == SPEND:
            changes = self.plan_spend(bits, request.pressure.bytes_free)
        else:
            changes = self.plan_free(bits, request.pressure.bytes_needed)
        index = {bid: i for i, bid in enumerate(self.block_ids)}
        rows = np.array([index[b] for b in changes], dtype=np.int64)
        delta = sum(self.cost[b][v] - self.cost[b][bits[b]] for b, v in changes.items())
        response = PlanResponse(request.request_id, len(self.requests), rows,
                                np.array(list(changes.values()), dtype=np.int64), delta, 0.0)
        self._queue.append([self.answer_after_polls, response])

    def poll(self) -> PlanResponse | None:
        if not self._queue:
            return None
        if self._queue[0][0] > 0:
            self._queue[0][0] -= 1
            return None
        return self._queue.popleft()[1]

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
