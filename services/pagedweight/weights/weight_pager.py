"""The weight pager: the controller between the engine, the planner and the page mover.

The engine calls it with KV pressure; the planner decides which blocks change bits; the
page mover changes them under its commit protocol (page_mover.py). All calls come from
the engine's thread, between forward steps.

The planner sits behind the `BitPlanner` protocol (bit_planner.py): the pager sends a
`PlanRequest` (KV pressure, the bits it is heading for, the routing snapshot since the
last request, the prompts in flight) and applies the `PlanResponse` whenever `poll` returns it: at once for an
in-process planner, at a later step boundary for a remote one. One request is in flight
at a time; while it is, the bytes it asks for count as pending.

- `request_bytes(n)`: the KV cache needs n more free bytes. Raises not yet started are
  cancelled first; if lowerings already planned (or asked for) do not free n bytes, the
  planner is asked for a plan freeing the rest. Non-blocking: the bytes are freed at a
  later `step_boundary()` (lowering drops planes there), and the engine waits meanwhile.
- `offer_bytes(n)`: pressure fell and n bytes are spare: the planner spends them on
  bits; raises start at a later boundary and commit when their copies land.
- `step_boundary()`: applies a plan that has arrived, commits finished moves, frees planes no step reads any more,
  starts raises, and after lowering compacts weight pages (moves them down) until the
  free page runs hold, as KV units of `kv_block_bytes` (the KV cache's per-layer tile;
  by default the size of the arena's latest KV allocation; with none seen yet, it
  compacts fully), the bytes asked for plus the whole units that were free when asked
  (or every free byte, if fewer). Tiles are small enough that a dropped plane's hole holds some,
  so this rarely moves anything; when it does, at most `compact_bytes_per_boundary` are
  copied and `compact_extents_per_boundary` extents moved per boundary (the rest at the
  next ones), so no boundary stalls a step for long. Returns what changed (a `BoundaryResult`).
Bytes are arena bytes (whole pages, LUTs included): what the KV cache really gets.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS, BlockId, check_bits
from pagedweight.planner.messages import FREE, KVPressure, PlanRequest, PlanResponse, PromptMix, RoutingSnapshot
from pagedweight.weights.bit_planner import BitPlanner
from pagedweight.weights.page_mover import BoundaryResult, PageMover


# Bytes one boundary's compaction may copy: ~20 us of an H200's HBM, a few ms on a CPU.
DEFAULT_COMPACT_BYTES = 32 << 20


def fewest_plane_drops(drop_bytes: np.ndarray, bits: np.ndarray, num_bytes: int) -> int:
    """The fewest one-bit drops that free `num_bytes`, blocks at `bits` (int [N]): drop_bytes[i, k]
    is what block i frees going from MIN_BITS + k + 1 to MIN_BITS + k bits. The largest drops
    first, each block's order aside (a lower bound where a block's deeper drops are larger, as
    4 -> 3 is, which also frees LUT_4); every drop when even all of them fall short."""
    return _fewest_covering(drop_bytes[_available_drops(drop_bytes, bits)], num_bytes)


def fewest_block_drops(drop_bytes: np.ndarray, bits: np.ndarray, num_bytes: int) -> int:
    """The fewest blocks whose lowering frees `num_bytes` (drop_bytes and bits as fewest_plane_drops):
    each block lowered as far as it goes (to MIN_BITS), the largest first; every block that can go
    lower when even all of them fall short. The page moves a pressure change cannot do without."""
    freeable = np.where(_available_drops(drop_bytes, bits), drop_bytes, 0).sum(axis=1)
    return _fewest_covering(freeable[freeable > 0], num_bytes)


def _available_drops(drop_bytes: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """[N, 5] whether block i can still take drop k (it is above MIN_BITS + k)."""
    return np.arange(drop_bytes.shape[1])[None, :] < (bits - MIN_BITS)[:, None]


def _fewest_covering(sizes: np.ndarray, num_bytes: int) -> int:
    """How many of `sizes`, the largest first, reach `num_bytes` (all of them when they fall short)."""
    if num_bytes <= 0:
        return 0
    sizes = np.sort(sizes)[::-1]
    reach = np.searchsorted(np.cumsum(sizes), num_bytes)  # first prefix freeing num_bytes
    return int(min(reach + 1, sizes.size))


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
    # Bit-planes the free plans lowered, and the fewest that could have freed what each asked
    # (fewest_plane_drops): their ratio is how many planes a pressure change moves beyond need.
    num_planes_lowered: int = 0
    num_planes_lowered_fewest: int = 0
    # Blocks the free plans lowered (a page move each), the fewest that could have freed what each
    # asked (fewest_block_drops), and the bytes the plans freed against the bytes asked.
    num_blocks_lowered: int = 0
    num_blocks_lowered_fewest: int = 0
    num_bytes_freed: int = 0
    num_bytes_asked: int = 0
    profile: dict | None = None  # PagerProfile.to_dict(): time, bytes each way, churn

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["bits_histogram"] = {str(b): n for b, n in self.bits_histogram.items()}
        return out


class WeightPager:
    def __init__(self, mover: PageMover, planner: BitPlanner, kv_block_bytes: int | None = None,
                 routing: Callable[[], RoutingSnapshot] | None = None,
                 prompts: Callable[[], PromptMix | None] | None = None,
                 latency: Callable[[], float] | None = None,
                 compact_bytes_per_boundary: int | None = DEFAULT_COMPACT_BYTES, compact_for_kv: bool = True,
                 compact_extents_per_boundary: int | None = None, compact_raises_while_running: bool = True):
        """`planner` is registered with this page table's blocks, in the table's order
        (in_process_planner.page_table_registration). `routing`: e.g. RoutingFeed.snapshot,
        the live routing sent with every request. `prompts`: the prompts in flight, sent
        with every request (engine/prompt_routing.py). `latency`: the engine's recent
        inter-token seconds, sent with every request (the dial's latency target)."""
        self.mover = mover
        self.table = mover.table
        self.planner = planner
        self.kv_block_bytes = kv_block_bytes  # the KV cache's block size (None: learnt from the arena)
        self.routing = routing
        self.prompts = prompts
        self.latency = latency
        # Compaction copies on the compute stream at a boundary: the cap bounds how long one
        # boundary can hold the next step back (None: no cap); the rest waits for later ones.
        self.compact_bytes_per_boundary = compact_bytes_per_boundary
        # ... and the extents it moves (None: no cap): each move is host work (allocation, copy
        # launch, free, a descriptor row) whatever its size, so many small LUT extents under
        # the byte cap still stall a boundary. Off in the runtime: a capped compaction for
        # raises that has not made room by the second idle boundary gives the raises up
        # (_drop_stalled_raises), and with a small cap the bits then stay down (the runtime and
        # worker idle-raise tests fail with 64); see docs/elasticity.md "What is left".
        self.compact_extents_per_boundary = compact_extents_per_boundary
        # False: never move weights to make KV room after lowering; a shortage left by
        # crumbs (hole remainders smaller than a KV tile) is met by the broker asking again,
        # i.e. by lowering a little more. With per-layer KV tiles that is far cheaper: on the
        # H200 at Qwen1.5-MoE's width compaction for KV moved 1.3 GB (and rewrote 12k kernel
        # descriptors) to gather the crumbs of 1.0 GB of lowering.
        self.compact_for_kv = compact_for_kv
        # False: compaction for raises waits for a boundary with no sequence running (the
        # broker says so); until then a raise starts only where a free run already holds it,
        # and the ones that do not are dropped by the stall rule and planned again when the
        # load has gone. Compaction copies on the compute stream and walks every extent on the
        # host (~8 ms a boundary at Qwen1.5-MoE's width, 0.26 s in one boundary of the H200
        # burst trace, docs/elasticity.md 2g-2h): with sequences running it stalls every one of
        # them for bits that matter less than their tokens.
        self.compact_raises_while_running = compact_raises_while_running
        self.num_compactions_deferred = 0  # boundaries that skipped compaction for raises (load running)
        self.block_ids: list[BlockId] = list(self.table.entries)  # the registration's block order
        self._request_ids = itertools.count(1)
        self._in_flight: PlanRequest | None = None  # the request whose response has not arrived
        self._cannot_free = False  # the last free plan changed nothing: every block is at its floor
        self._free_bytes_at_refusal = -1  # pool free bytes when a spend plan last took nothing
        self._kv_target_bytes = 0  # what compaction must make usable as KV blocks
        self._compaction_left = False  # a capped compaction goes on at the next boundaries
        self._gathered_at = None  # (free bytes, fitting KV units) when scattered bytes were last promised
        self.num_plans = 0
        self.num_raises_dropped = 0  # raises given up because they could not start (see below)
        self.offer_outcomes: Counter = Counter()  # offer_bytes results by reason
        self.num_routing_non_finite = 0  # routing snapshots with NaN/inf, cleaned before planning
        self._stalled_boundaries = 0
        self._free_bytes_at_drop = -1  # pool free bytes when raises were last dropped
        self._mean_min = self._mean_bits()
        self._drop_bytes: np.ndarray | None = None  # [N, 5] bytes each one-bit drop frees (fewest_plane_drops)
        self.num_planes_lowered = 0
        self.num_planes_lowered_fewest = 0
        self.num_blocks_lowered = 0
        self.num_blocks_lowered_fewest = 0
        self.num_bytes_freed = 0
        self.num_bytes_asked = 0
        self._last_applied_bytes = 0  # arena bytes the last applied plan took (< 0: freed)
        # Every block at its desired bits, no copy in flight, no plan applied since: a step
        # boundary has nothing to do. Anything that changes desired bits clears it.
        self._settled = False
        self._settled_at = -1  # the table's num_desired_updates when it settled

    # ---- pressure -----------------------------------------------------------------------
    def request_bytes(self, num_bytes: int) -> int:
        """Plan lowerings freeing at least `num_bytes` (with those already planned);
        returns the bytes the pending lowerings will free (less than asked when every
        block is at its floor)."""
        self._free_bytes_at_drop = self._free_bytes_at_refusal = -1  # bits go down: what is free afterwards is new
        self._kv_target_bytes = max(self._kv_target_bytes, num_bytes + self._usable_kv_bytes())
        if not self._is_settled():  # settled: no raise is waiting to start
            for e in self.table.unsettled():  # cancel raises that have not started
                e.desired_bits = min(e.desired_bits, e.effective_bits)
        if self._in_flight is not None and self._in_flight.pressure.direction != FREE:
            self._in_flight = None  # a spend asked before pressure rose: its answer is dropped
        pending = self._pending_free() + self._asked_free()
        if pending < num_bytes and self._in_flight is None and not self._cannot_free:
            self._submit(KVPressure(bytes_needed=num_bytes - pending))
            pending = self._pending_free() + self._asked_free()
        if pending < num_bytes:
            pending += self._gather_scattered()
        return pending

    def _gather_scattered(self) -> int:
        """Free bytes that lie in runs too short for a KV unit but would hold whole units once
        compacted: a compaction is scheduled for the next boundary and the bytes count as
        coming. With every block at its floor this is the only way left to make KV room (a
        block lowered from 4 to 3 bits leaves a hole of LUT_4 pages LUT_3 does not fill). Once
        per arena state: after a compaction that gathered nothing the same crumbs are not
        promised again, so a request that cannot fit is told so instead of waiting for ever."""
        arena = self.mover.arena
        unit = self.kv_block_bytes or arena.last_kv_bytes
        if unit is None:
            return 0
        whole_units = arena.num_free_pages // arena.pages_for(unit)
        gatherable = (whole_units - arena.num_fitting(unit)) * arena.charged_bytes(unit)
        state = (arena.pool.free_bytes, arena.num_fitting(unit))
        if gatherable <= 0 or state == self._gathered_at:
            return 0
        self._gathered_at = state
        self._kv_target_bytes = max(self._kv_target_bytes, whole_units * arena.charged_bytes(unit))
        self._compaction_left = True
        return gatherable

    def offer_bytes(self, num_bytes: int) -> int:
        """Spend up to `num_bytes` spare bytes on bits; returns the bytes planned.
        Ignored (0) while lowerings are still pending: pressure has not fallen yet."""
        outcomes = self.offer_outcomes  # why offers were taken or not (the profile reports them)
        if self._in_flight is not None:
            outcomes["plan_in_flight"] += 1
            return 0
        free_bytes = self.mover.arena.pool.free_bytes
        if free_bytes <= max(self._free_bytes_at_drop, self._free_bytes_at_refusal):
            outcomes["no_new_bytes"] += 1
            return 0  # these bytes could not hold the last plan's raises, or found no use
        settled = self._is_settled()  # then nothing is pending: skip the scans
        if not settled and self._pending_free() > 0:
            outcomes["lowering_pending"] += 1
            return 0
        spendable = num_bytes - (0 if settled else self._pending_take())
        if spendable <= 0:
            outcomes["raises_pending"] += 1
            return 0
        request = self._submit(KVPressure(bytes_free=spendable))
        if self._in_flight is request:  # not answered yet: the planner may spend all of it
            outcomes["asked"] += 1
            return spendable
        outcomes["planned" if self._last_applied_bytes > 0 else "planner_spent_nothing"] += 1
        return self._last_applied_bytes

    # ---- the planner's side of the seam -------------------------------------------------
    def _submit(self, pressure: KVPressure) -> PlanRequest:
        # the table's entries keep the registration's order (block_ids): no lookup per block
        bits = np.fromiter((e.desired_bits for e in self.table.entries.values()), dtype=np.int64,
                           count=len(self.block_ids))
        routing = self._finite(self.routing()) if self.routing is not None else None
        prompts = self.prompts() if self.prompts is not None else None
        inter_token_s = self.latency() if self.latency is not None else 0.0
        request = PlanRequest(next(self._request_ids), pressure, bits, routing, prompts, inter_token_s)
        self._in_flight = request
        self.num_plans += 1
        with self.mover.profile.timed("plan"):
            self.planner.submit(request)
            self._apply_arrived()  # an in-process planner has answered already; a remote one later
        return request

    def _finite(self, snapshot: RoutingSnapshot) -> RoutingSnapshot:
        """The snapshot with non-finite counts or mass read as 0 (counted): one NaN step
        would stay in the planner's moving average for good and make every raise look
        worthless (a NaN damage step is never taken), so bits would never come back."""
        if np.isfinite(snapshot.counts).all() and np.isfinite(snapshot.mass).all():
            return snapshot
        self.num_routing_non_finite += 1
        clean = lambda a: np.nan_to_num(np.asarray(a, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        return RoutingSnapshot(clean(snapshot.counts), clean(snapshot.mass), snapshot.num_tokens)

    def _apply_arrived(self) -> None:
        """Apply every response that has arrived; only the one to the request in flight counts."""
        while (response := self.planner.poll()) is not None:
            request = self._in_flight
            if request is None or response.request_id != request.request_id:
                continue  # answers a request given up since (pressure changed direction)
            self._in_flight = None
            self._apply(request, response)

    def _apply(self, request: PlanRequest, response: PlanResponse) -> None:
        entries, taken = self.table.entries, 0
        free = request.pressure.direction == FREE
        if not free and self._pending_free() > 0:
            return  # pressure rose while the spend was planned: raising now would fight it
        lowered = blocks = 0
        for index, bits in response.changes().items():
            check_bits(bits)
            bid = self.block_ids[index]
            e = entries[bid]
            new = min(e.desired_bits, bits) if free else max(e.desired_bits, bits)
            taken += self.table.charged_bytes(bid, new) - self.table.charged_bytes(bid, e.desired_bits)
            lowered += e.desired_bits - new
            blocks += new < e.desired_bits
            e.desired_bits = new
        if free and lowered:
            drop_bytes, asked = self._plane_drop_bytes(), request.pressure.bytes_needed
            self.num_planes_lowered += lowered
            self.num_planes_lowered_fewest += fewest_plane_drops(drop_bytes, request.bits, asked)
            self.num_blocks_lowered += blocks
            self.num_blocks_lowered_fewest += fewest_block_drops(drop_bytes, request.bits, asked)
            self.num_bytes_freed -= taken
            self.num_bytes_asked += asked
        self._last_applied_bytes = taken
        self._settled = self._settled and taken == 0
        if free:
            self._cannot_free = taken == 0
        elif taken > 0:
            self._cannot_free = False  # bits went up: there is something to free again
        else:
            self._free_bytes_at_refusal = self.mover.arena.pool.free_bytes

    def step_boundary(self, sequences_running: bool = False) -> BoundaryResult:
        """`sequences_running`: some sequence holds KV (the broker knows); with
        `compact_raises_while_running` off, no compaction for raises at this boundary."""
        with self.mover.profile.timed("boundary"):
            return self._step_boundary(sequences_running)

    def _step_boundary(self, sequences_running: bool = False) -> BoundaryResult:
        if self._in_flight is not None:
            self._apply_arrived()
        if self._compaction_left:
            self._compact()  # before anything else: the KV cache is waiting for these bytes
        if self._is_settled():
            return BoundaryResult()  # nothing to commit, lower or raise: no scan over the blocks
        result = self.mover.step_boundary(self._raise_order())
        self.mover.profile.num_boundaries_with_work += bool(
            result.lowered_ids or result.started_ids or result.committed_ids)
        if result.lowered_ids and self.compact_for_kv:
            self._compact()
        elif result.num_raises_fragmented:  # the raises retry at the next boundary
            if sequences_running and not self.compact_raises_while_running:
                self.num_compactions_deferred += 1
            else:
                self.mover.compact(max_bytes=self.compact_bytes_per_boundary, phase="compact_for_raise",
                                   max_moves=self.compact_extents_per_boundary)
        self._drop_stalled_raises(result)
        self._mean_min = min(self._mean_min, self._mean_bits())
        self._settled = not self.mover.busy()
        self._settled_at = self.table.num_desired_updates
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
            e for e in self.table.unsettled() if e.desired_bits > e.committed_bits and not e.transit_bits]
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

    def wants_boundaries(self, offer_bytes: int) -> bool:
        """Whether a step boundary, or an offer of `offer_bytes` (< 0: none), could still
        change anything: a plan or a compaction in flight, blocks not at their desired
        bits, or more free bytes than the last offer found no use for. O(1): an idle
        worker asks this on every tick to know when to stop ticking."""
        if self._in_flight is not None or self._compaction_left or not self._is_settled():
            return True
        return offer_bytes > max(self._free_bytes_at_drop, self._free_bytes_at_refusal)

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
            num_planes_lowered=self.num_planes_lowered,
            num_planes_lowered_fewest=self.num_planes_lowered_fewest,
            num_blocks_lowered=self.num_blocks_lowered,
            num_blocks_lowered_fewest=self.num_blocks_lowered_fewest,
            num_bytes_freed=self.num_bytes_freed,
            num_bytes_asked=self.num_bytes_asked,
            profile=self.mover.profile.to_dict() | {
                "descriptor_updates": self.table.num_descriptor_updates,
                "descriptor_seconds": round(self.table.descriptor_seconds, 6),
                "offers": dict(self.offer_outcomes), "raises_dropped": self.num_raises_dropped,
                "compactions_deferred": self.num_compactions_deferred,
                "routing_non_finite": self.num_routing_non_finite},
        )

    # ---- internals ----------------------------------------------------------------------
    def _is_settled(self) -> bool:
        return self._settled and self._settled_at == self.table.num_desired_updates

    def _asked_free(self) -> int:
        """Bytes the free request in flight asks for (counted as pending until it is answered)."""
        request = self._in_flight
        return request.pressure.bytes_needed if request is not None and request.pressure.direction == FREE else 0

    def _usable_kv_bytes(self) -> int:
        """Free bytes the KV cache can use as they lie: whole KV units in free runs (all free
        bytes while the unit is unknown). Crumbs smaller than a unit are not counted, so
        compaction never runs just to gather them: the bytes asked for are on top of these."""
        arena = self.mover.arena
        unit = self.kv_block_bytes or arena.last_kv_bytes
        if unit is None:
            return arena.pool.free_bytes
        return arena.num_fitting(unit) * arena.charged_bytes(unit)

    def _compact(self) -> None:
        """Compact toward the KV target, at most compact_bytes_per_boundary this boundary;
        a capped compaction keeps its target and goes on at the next boundary."""
        profile, target = self.mover.profile, self._kv_target_bytes
        capped_before = profile.num_compaction_capped
        self._compact_toward_target()
        self._compaction_left = profile.num_compaction_capped > capped_before
        if self._compaction_left:
            self._kv_target_bytes = max(self._kv_target_bytes, target)

    def _compact_toward_target(self) -> None:
        arena, target = self.mover.arena, self._kv_target_bytes
        self._kv_target_bytes = 0
        block_bytes = self.kv_block_bytes or arena.last_kv_bytes
        cap, moves = self.compact_bytes_per_boundary, self.compact_extents_per_boundary
        if block_bytes is None:
            self.mover.compact(max_bytes=cap, max_moves=moves)
            return
        num_blocks = min(arena.num_free_pages // arena.pages_for(block_bytes), -(-target // block_bytes))
        self.mover.compact(done=lambda: arena.num_fitting(block_bytes) >= num_blocks, max_bytes=cap, max_moves=moves)

    def _plane_drop_bytes(self) -> np.ndarray:
        """[N, 5] the bytes each block's one-bit drops free (bits 4..8 -> one less), in the
        registration's order; the block sizes never change, so built once."""
        if self._drop_bytes is None:
            charged = self.table.charged_bytes
            by_bits = np.array([[charged(bid, b) for b in BIT_WIDTHS] for bid in self.block_ids], dtype=np.int64)
            self._drop_bytes = np.diff(by_bits, axis=1)
        return self._drop_bytes

    def _mean_bits(self) -> float:
        return self.table.mean_committed_bits()  # kept by the table: no scan per boundary

    def _pending_free(self) -> int:
        """Arena bytes that planned lowerings will free."""
        charged = self.table.charged_bytes
        return sum(charged(e.block_id, q) - charged(e.block_id, e.desired_bits) for e in self.table.unsettled()
                   if e.desired_bits < (q := e.transit_bits or e.committed_bits))  # q: effective bits

    def _pending_take(self) -> int:
        """Arena bytes that planned raises, not yet started, will take."""
        charged = self.table.charged_bytes
        return sum(charged(e.block_id, e.desired_bits) - charged(e.block_id, q) for e in self.table.unsettled()
                   if e.desired_bits > (q := e.transit_bits or e.committed_bits))  # q: effective bits

    def _raise_order(self) -> list[BlockId]:
        """A layer's raises together, layer by layer; in a layer the blocks furthest below
        their desired bits first. When the bytes free hold only some raises, whole layers
        come back first: a layer's bit classes (what its decode launches and a captured
        decode graph depend on) then change once, not at every boundary that lands a few."""
        unsettled = self.table.unsettled()
        order = sorted(unsettled, key=lambda e: (e.block_id.layer, e.committed_bits - e.desired_bits))
        return [e.block_id for e in order]
