"""The weight pager: the controller between the engine, the planner and the page mover.

The engine calls it with KV pressure; the planner decides which blocks change bits; the
page mover changes them under its commit protocol (page_mover.py). All calls come from
the engine's thread, between forward steps.

- `request_bytes(n)`: the KV cache needs n more free bytes. Raises not yet started are
  cancelled first; if lowerings already planned do not free n bytes, the planner is
  asked for a plan freeing the rest. Non-blocking: the bytes are freed at the next
  `step_boundary()` (lowering drops planes there), and the engine waits meanwhile.
- `offer_bytes(n)`: pressure fell and n bytes are spare: the planner spends them on
  bits; raises start at the next boundary and commit when their copies land.
- `step_boundary()`: commits finished moves, frees planes no step reads any more,
  starts raises, and after lowering compacts weight pages (moves them down) until the
  free page runs hold, as KV blocks of `kv_block_bytes` (by default the size of the
  arena's latest KV allocation; with none seen yet, it compacts fully), the bytes asked
  for plus those that were free when asked (or every free byte, if fewer). Returns what changed (a `BoundaryResult`).
Bytes are arena bytes (whole pages, LUTs included): what the KV cache really gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedweight.format.apl_format import BIT_WIDTHS, BlockId
from pagedweight.weights.greedy_planner import BitPlanner
from pagedweight.weights.page_mover import BoundaryResult, PageMover


@dataclass(frozen=True)
class PagerStats:
    bits_histogram: dict[int, int]  # bits -> blocks committed at bits
    mean_committed_bits: float  # bits per expert weight (blocks weighted by size)
    mean_committed_bits_min: float  # the lowest mean seen at any boundary
    num_page_moves: int  # committed bit changes (raises committed + lowerings)
    num_plans: int  # plans asked of the planner
    num_planes_copied: int
    num_planes_dropped: int
    num_bytes_copied: int
    num_extents_relocated: int  # by compaction
    num_blocks_in_transit: int
    num_blocks_pending: int  # blocks whose desired bits differ from committed

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["bits_histogram"] = {str(b): n for b, n in self.bits_histogram.items()}
        return out


class WeightPager:
    def __init__(self, mover: PageMover, planner: BitPlanner, kv_block_bytes: int | None = None,
                 before_plan: Callable[[], None] | None = None):
        self.mover = mover
        self.table = mover.table
        self.planner = planner
        self.kv_block_bytes = kv_block_bytes  # the KV cache's block size (None: learnt from the arena)
        self.before_plan = before_plan  # e.g. RoutingFeed.refresh: live routing into the planner
        self._kv_target_bytes = 0  # what compaction must make usable as KV blocks
        self.num_plans = 0
        self.num_raises_dropped = 0  # raises given up because they could not start (see below)
        self._stalled_boundaries = 0
        self._free_bytes_at_drop = -1  # pool free bytes when raises were last dropped
        self._mean_min = self._mean_bits()

    # ---- pressure -----------------------------------------------------------------------
    def request_bytes(self, num_bytes: int) -> int:
        """Plan lowerings freeing at least `num_bytes` (with those already planned);
        returns the bytes the pending lowerings will free (less than asked when every
        block is at its floor)."""
        entries = self.table.entries
        self._free_bytes_at_drop = -1  # bits go down: what is free afterwards is new
        self._kv_target_bytes = max(self._kv_target_bytes, num_bytes + self.mover.arena.pool.free_bytes)
        for e in entries.values():  # cancel raises that have not started
            e.desired_bits = min(e.desired_bits, e.effective_bits)
        pending = self._pending_free()
        if pending < num_bytes:
            bits = {bid: e.desired_bits for bid, e in entries.items()}  # block_id -> bits
            self._before_plan()
            plan = self.planner.plan_free(bits, num_bytes - pending)
            self.num_plans += 1
            self.table.set_desired_bits(plan)
            pending = self._pending_free()
        return pending

    def offer_bytes(self, num_bytes: int) -> int:
        """Spend up to `num_bytes` spare bytes on bits; returns the bytes planned.
        Ignored (0) while lowerings are still pending: pressure has not fallen yet."""
        if self._pending_free() > 0:
            return 0
        if self.mover.arena.pool.free_bytes <= self._free_bytes_at_drop:
            return 0  # these bytes could not hold the last plan's raises in flight
        spendable = num_bytes - self._pending_take()
        if spendable <= 0:
            return 0
        bits = self.table.desired_bits()
        self._before_plan()
        plan = self.planner.plan_spend(bits, spendable)
        self.num_plans += 1
        self.table.set_desired_bits(plan)
        return sum(self.table.charged_bytes(bid, b) - self.table.charged_bytes(bid, bits[bid]) for bid, b in plan.items())

    def step_boundary(self) -> BoundaryResult:
        result = self.mover.step_boundary(self._raise_order())
        if result.lowered_ids:
            self._compact()
        elif result.num_raises_fragmented:
            self.mover.compact()  # the raises retry at the next boundary
        self._drop_stalled_raises(result)
        self._mean_min = min(self._mean_min, self._mean_bits())
        return result

    def _drop_stalled_raises(self, result: BoundaryResult) -> None:
        """Give up raises the arena cannot start even after a compaction.

        A raise holds the new LUT beside the old one until it commits, so a plan that fits
        in net bytes can still find no room in flight; waiting would keep the pager busy
        for ever. When a boundary starts, commits and lowers nothing with no copy in
        flight, twice in a row (the first is followed by a compaction), the waiting raises
        are cancelled; a later offer plans them again with the bytes then free."""
        idle = not (result.started_ids or result.committed_ids or result.lowered_ids)
        # Cheap tests first: this runs at every step boundary, the scan below only when idle.
        waiting = [] if not idle or self.mover.in_transit_extents() else [
            e for e in self.table.entries.values() if e.desired_bits > e.committed_bits and not e.transit_bits]
        if not waiting:
            self._stalled_boundaries = 0
            return
        self._stalled_boundaries += 1
        if self._stalled_boundaries >= 2:
            for e in waiting:
                e.desired_bits = e.committed_bits
            self.num_raises_dropped += len(waiting)
            self._stalled_boundaries = 0
            self._free_bytes_at_drop = self.mover.arena.pool.free_bytes

    def busy(self) -> bool:
        return self.mover.busy()

    # ---- reporting ----------------------------------------------------------------------
    def stats(self) -> PagerStats:
        entries = self.table.entries.values()
        histogram = {b: 0 for b in BIT_WIDTHS}
        for e in entries:
            if e.committed_bits:
                histogram[e.committed_bits] += 1
        c = self.mover.counters
        return PagerStats(
            bits_histogram=histogram,
            mean_committed_bits=self._mean_bits(),
            mean_committed_bits_min=min(self._mean_min, self._mean_bits()),
            num_page_moves=c.num_raises_committed + c.num_lowerings,
            num_plans=self.num_plans,
            num_planes_copied=c.num_planes_copied,
            num_planes_dropped=c.num_planes_dropped,
            num_bytes_copied=c.num_bytes_copied,
            num_extents_relocated=c.num_extents_relocated,
            num_blocks_in_transit=sum(1 for e in entries if e.transit_bits),
            num_blocks_pending=sum(1 for e in entries if e.desired_bits != e.committed_bits),
        )

    # ---- internals ----------------------------------------------------------------------
    def _before_plan(self) -> None:
        if self.before_plan is not None:
            self.before_plan()

    def _compact(self) -> None:
        arena, target = self.mover.arena, self._kv_target_bytes
        self._kv_target_bytes = 0
        block_bytes = self.kv_block_bytes or arena.last_kv_bytes
        if block_bytes is None:
            self.mover.compact()
            return
        num_blocks = min(arena.num_free_pages // arena.pages_for(block_bytes), -(-target // block_bytes))
        self.mover.compact(done=lambda: arena.num_fitting(block_bytes) >= num_blocks)

    def _mean_bits(self) -> float:
        entries = self.table.entries.values()
        num_weights = sum(e.num_weights for e in entries)
        return sum(e.committed_bits * e.num_weights for e in entries) / max(num_weights, 1)

    def _pending_free(self) -> int:
        """Arena bytes that planned lowerings will free."""
        return sum(self.table.charged_bytes(bid, e.effective_bits) - self.table.charged_bytes(bid, e.desired_bits)
                   for bid, e in self.table.entries.items() if e.desired_bits < e.effective_bits)

    def _pending_take(self) -> int:
        """Arena bytes that planned raises, not yet started, will take."""
        return sum(self.table.charged_bytes(bid, e.desired_bits) - self.table.charged_bytes(bid, e.effective_bits)
                   for bid, e in self.table.entries.items() if e.desired_bits > e.effective_bits)

    def _raise_order(self) -> list[BlockId]:
        """Raise the blocks furthest below their desired bits first."""
        entries = self.table.entries
        return sorted(entries, key=lambda bid: entries[bid].committed_bits - entries[bid].desired_bits)
