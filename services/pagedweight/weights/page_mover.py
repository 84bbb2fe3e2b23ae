"""The page mover: changes committed bit-widths q_i without ever exposing a torn page.

Commit protocol (all page-table changes happen in `step_boundary`, called by the engine
between two forward steps, never during one):

1. Commit finished raises. A raise q -> b was started at an earlier boundary: planes
   q..b-1 and LUT_b were allocated as TRANSIT extents that are not in the page table
   entry, then copied from host memory on a side CUDA stream (a worker thread on CPU).
   Once its copy is done (CUDA event / future), the extents join the entry, q_i = b,
   the old LUT_q is freed, and the bytes are relabelled expert@b.
2. Lower blocks with d_i < q_i (not in transit; one in transit is lowered at the
   boundary after its copy lands). The planes b..q-1 and LUT_q are freed now: every step
   that read them has been issued, and every later writer of those bytes is ordered
   after it (KV writes, LUT and compaction copies run on the compute stream; raise
   copies make the side stream wait for the compute stream first). The new LUT_b is
   copied from host memory on the compute stream, so the next step sees it; it needs no
   spare memory because the freed LUT_q alone is larger.
3. Start raises for blocks with d_i > q_i, in the order given, while the arena can
   hold their new planes; the rest wait for a later boundary. A raise goes part of the way
   only when no whole one could start and no copy is in flight (and always to a bit-width:
   a CPU-only block comes in at MIN_BITS or not at all).

A forward step therefore reads, for every block, exactly the committed planes and LUT
at q_i: the output equals the static model at the committed bits, whatever is in flight.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedweight.memory.arena import Arena, ArenaFragmented, Extent
from pagedweight.memory.pool import TRANSIT, BudgetExceeded, expert_kind
from pagedweight.format.apl_format import MIN_BITS, BlockId, lut_width
from pagedweight.weights.page_table import BlockPages, PageTable
from pagedweight.weights.pager_profile import PagerProfile


@dataclass
class _Transit:
    target_bits: int
    plane_extents: list[Extent]  # planes q..b-1
    lut_extent: Extent  # LUT_b
    done: Callable[[], bool]


@dataclass
class BoundaryResult:
    """What one step boundary changed."""

    committed_ids: list[BlockId] = field(default_factory=list)  # raises committed
    lowered_ids: list[BlockId] = field(default_factory=list)  # lowerings applied
    started_ids: list[BlockId] = field(default_factory=list)  # raises started
    num_bytes_freed: int = 0  # arena bytes released (planes and LUTs dropped)
    num_bytes_taken: int = 0  # arena bytes allocated (new LUTs, transit planes)
    num_raises_fragmented: int = 0  # raises the pool had bytes for but no page run was long enough


@dataclass
class MoverCounters:
    num_raises_committed: int = 0
    num_lowerings: int = 0
    num_planes_copied: int = 0
    num_planes_dropped: int = 0
    num_bytes_copied: int = 0
    num_extents_relocated: int = 0


class _Copier:
    """Runs host->arena copies off the compute path: a side CUDA stream, or one thread on CPU."""

    def __init__(self, device: torch.device, before_copy: Callable[[], None] | None):
        self.cuda = device.type == "cuda"
        self.before_copy = before_copy  # test hook: called in the copy thread before copying
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
        else:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="page-mover")

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], bool]:
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # after every step already issued
            with torch.cuda.stream(self.stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event.query
        future: Future = self.pool.submit(self._copy_all, pairs)
        return future.done

    def _copy_all(self, pairs):
        if self.before_copy is not None:
            self.before_copy()
        for dst, src in pairs:
            dst.copy_(src)

    def close(self):
        if not self.cuda:
            self.pool.shutdown(wait=True)


class PageMover:
    def __init__(self, table: PageTable, before_copy: Callable[[], None] | None = None):
        self.table = table
        self.arena: Arena = table.arena
        self._transits: dict[BlockId, _Transit] = {}  # block_id -> copy in flight
        self._copier = _Copier(self.arena.device, before_copy)
        self.counters = MoverCounters()
        self.profile = PagerProfile()

    # ---- the protocol -----------------------------------------------------------------
    def step_boundary(self, raise_order: list[BlockId] | None = None) -> BoundaryResult:
        """Commit finished raises, apply lowerings, start raises (see the module doc)."""
        result, profile = BoundaryResult(), self.profile
        with profile.timed("raise_commit"):
            for bid in [b for b, t in self._transits.items() if t.done()]:
                self._commit_raise(bid, result)
        unsettled = self.table.unsettled()  # the dirty set: O(blocks changed), not O(all)
        with profile.timed("lower"):
            for e in unsettled:
                if e.desired_bits < e.committed_bits and not e.transit_bits:
                    self._lower(e, result)
        with profile.timed("raise_start"):
            order = raise_order if raise_order is not None else [e.block_id for e in unsettled]
            # Whole raises first: a raise cut short by the bytes free now lands in two commits
            # (two descriptor rewrites, maybe two decode-graph captures). Part of the way only
            # when no whole raise could start and no copy is in flight to free bytes later.
            for partial in (False, True):
                if partial and self._transits:
                    break
                for bid in order:
                    e = self.table.entries[bid]
                    if e.desired_bits > e.committed_bits and not e.transit_bits:
                        if self._start_raise(e, result, partial):
                            result.started_ids.append(bid)
        return result

    def busy(self) -> bool:
        """A copy is in flight or some block is not yet at its desired bits."""
        return bool(self._transits) or any(e.desired_bits != e.committed_bits for e in self.table.unsettled())

    def in_transit_extents(self) -> list[Extent]:
        return [x for t in self._transits.values() for x in t.plane_extents + [t.lut_extent]]

    def load_all(self) -> None:
        """Start-up: bring every block to its desired bits and wait (no step is running)."""
        while self.busy():
            before = len(self._transits)
            result = self.step_boundary()
            if not self._transits and not result.started_ids and not result.lowered_ids and before == 0:
                raise BudgetExceeded("the arena cannot hold every expert block at its desired bits")
            self.wait_for_transits()

    def wait_for_transits(self) -> None:
        if self.arena.device.type == "cuda":
            self._copier.stream.synchronize()
        else:
            while not all(t.done() for t in self._transits.values()):
                threading.Event().wait(0.0005)

    def close(self) -> None:
        self._copier.close()

    # ---- raise ------------------------------------------------------------------------
    def _transit_bytes(self, bid: BlockId, q: int, b: int) -> int:
        """Arena bytes a raise q -> b holds while in flight (LUT_q stays until commit)."""
        return ((b - q) * self.arena.charged_bytes(self.table.plane_bytes(bid))
                + self.arena.charged_bytes(self.table.lut_bytes(bid, b)))

    def _start_raise(self, e: BlockPages, result: BoundaryResult, partial: bool = True) -> bool:
        """Start copying toward d_i: all the way if the pool has the bytes, else (`partial`)
        as far as it has (the rest follows at a later boundary)."""
        bid, q = e.block_id, e.committed_bits
        free = self.arena.pool.free_bytes
        # Only a bit-width has a LUT: a partial raise of a CPU-only block (q = 0) must still
        # land at MIN_BITS or more, never at 1 or 2 bits (committed bits are 0 or a width).
        lowest = max(q + 1, MIN_BITS) if partial else e.desired_bits
        b = next((b for b in range(e.desired_bits, lowest - 1, -1)
                  if self._transit_bytes(bid, q, b) <= free), None)
        if b is None:
            return False
        host = self.table.host[bid]
        extents: list[Extent] = []
        lut_extent = None
        try:
            # the LUT first: with format 2's LUT sizes it is often the larger extent, and
            # placed after the planes it may find only their leftovers (first fit)
            lut_extent = self.arena.allocate(TRANSIT, self.table.lut_bytes(bid, b))
            for _ in range(q, b):
                extents.append(self.arena.allocate(TRANSIT, self.table.plane_bytes(bid)))
        except (BudgetExceeded, ArenaFragmented) as err:
            for x in extents + ([lut_extent] if lut_extent is not None else []):
                self.arena.free(x)
            result.num_raises_fragmented += isinstance(err, ArenaFragmented)
            return False
        pairs = [(self.arena.view(x, torch.uint8, (e.rows, e.cols // 8)), host.planes[p])
                 for p, x in zip(range(q, b), extents)]
        lut = host.lut(b)
        pairs.append((self.arena.view(lut_extent, lut.dtype, tuple(lut.shape)), lut))
        self._transits[bid] = _Transit(b, extents, lut_extent, self._copier.submit(pairs))
        e.transit_bits = b
        result.num_bytes_taken += sum(x.num_pages for x in extents + [lut_extent]) * self.arena.page_bytes
        self.profile.bytes_host_to_device += sum(x.num_bytes for x in extents + [lut_extent])
        return True

    def _commit_raise(self, bid: BlockId, result: BoundaryResult) -> None:
        t = self._transits.pop(bid)
        e = self.table.entries[bid]
        kind = expert_kind(t.target_bits)
        if e.lut_extent is not None:
            result.num_bytes_freed += self._free(e.lut_extent)
        kept = self.arena.relabel_many(e.plane_extents, kind)
        new = self.arena.relabel_many(t.plane_extents + [t.lut_extent], kind)
        e.plane_extents = kept + new[:-1]
        e.lut_extent = new[-1]
        new = new[:-1]
        self.counters.num_planes_copied += len(new)
        self.counters.num_bytes_copied += sum(x.num_bytes for x in new) + t.lut_extent.num_bytes
        self.counters.num_raises_committed += 1
        self.profile.ups[bid] += 1
        e.committed_bits, e.transit_bits = t.target_bits, 0
        e.version += 1
        result.committed_ids.append(bid)

    # ---- lower ------------------------------------------------------------------------
    def _lower(self, e: BlockPages, result: BoundaryResult) -> None:
        bid, b = e.block_id, e.desired_bits
        dropped = e.plane_extents[b:]
        # From 4 bits down to 4 or more the block reads the same stored LUT (LUT_4): it stays
        # where it is, so a lowering frees only planes and copies nothing (a fresh copy of the
        # same bytes would leave a LUT-sized hole somewhere else, fragmenting the arena).
        same_lut = lut_width(b) == lut_width(e.committed_bits)
        for x in dropped + ([] if same_lut else [e.lut_extent]):
            freed = self._free(x)
            result.num_bytes_freed += freed
            self.profile.bytes_freed_by_lowering += freed
        kind = expert_kind(b)
        if same_lut:
            lut_extent = self.arena.relabel_many([e.lut_extent], kind)[0]
        else:
            lut = self.table.host[bid].lut(b)
            lut_extent = self.arena.allocate(kind, lut.numel() * lut.element_size())  # fits: LUT_q was no smaller
            self.arena.view(lut_extent, lut.dtype, tuple(lut.shape)).copy_(lut, non_blocking=True)  # compute stream
            result.num_bytes_taken += lut_extent.num_pages * self.arena.page_bytes
            self.profile.bytes_host_to_device += lut_extent.num_bytes
        self.profile.downs[bid] += 1
        e.plane_extents = self.arena.relabel_many(e.plane_extents[:b], kind)
        e.lut_extent = lut_extent
        e.committed_bits = b
        e.version += 1
        self.counters.num_planes_dropped += len(dropped)
        self.counters.num_lowerings += 1
        result.lowered_ids.append(bid)

    def _free(self, extent: Extent) -> int:
        self.arena.free(extent)
        return extent.num_pages * self.arena.page_bytes

    # ---- compaction -------------------------------------------------------------------
    def compact(self, done: Callable[[], bool] = lambda: False, max_bytes: int | None = None,
                phase: str = "compact", max_moves: int | None = None) -> int:
        """Move committed weight extents down into lower free runs (or, where none holds one,
        onto the hole right below it), so that the pages freed by lowering join the free
        space next to the KV region; stop early once
        `done()`, or once `max_bytes` have been copied or `max_moves` extents moved (None:
        no cap). Copies run on the compute stream at a step boundary (readers see the new
        place from the next step), so the caps bound what one boundary can stall the next
        step by: the bytes bound the copies, the moves the host work (each move is an
        allocation, a copy launch, a free and a descriptor row to rewrite, whatever its
        size). A capped compaction goes on at a later boundary. Returns the extents moved."""
        with self.profile.timed(phase):  # "compact" for KV room, "compact_for_raise" for raises
            moved, capped = self._compact(done, max_bytes, max_moves)
        self.profile.num_compaction_capped += capped
        return moved

    def _compact(self, done: Callable[[], bool], max_bytes: int | None,
                 max_moves: int | None = None) -> tuple[int, bool]:
        # Only allocating and freeing change what can move, so the lowest fit per extent
        # size (a handful of sizes: planes, LUTs) is cached between moves, and `done()` is
        # asked only after one: a scan over 10^5 extents then costs a dict lookup each.
        if done():
            return 0, False
        owners = {}  # first_page -> (entry, index in plane_extents or -1 for the LUT)
        for e in self.table.entries.values():
            for i, x in enumerate(e.plane_extents):
                owners[x.first_page] = (e, i)
            if e.lut_extent is not None:
                owners[e.lut_extent.first_page] = (e, -1)
        lowest: dict[int, int | None] = {}  # num_pages -> lowest fit (cleared after every move)
        moved = copied = 0

        def at_cap() -> bool:
            return (max_bytes is not None and copied >= max_bytes) or (max_moves is not None and moved >= max_moves)

        for start in sorted(owners):
            if at_cap():
                break
            e, i = owners[start]
            old = e.plane_extents[i] if i >= 0 else e.lut_extent
            if old.num_pages not in lowest:
                lowest[old.num_pages] = self.arena.lowest_fit(old.num_pages)
            fit = lowest[old.num_pages]
            if fit is not None and fit < old.first_page:
                new = self.arena.allocate(old.kind, old.num_bytes)
                self.arena.view(new, torch.uint8, (old.num_bytes,)).copy_(
                    self.arena.view(old, torch.uint8, (old.num_bytes,)))
                self.arena.free(old)
            else:  # no lower run holds it: onto the hole right below it, if there is one
                new = self.arena.slide_down(old)
                if new is None:
                    continue
            if i >= 0:
                e.plane_extents[i] = new
            else:
                e.lut_extent = new
            e.version += 1
            moved += 1
            copied += old.num_bytes
            lowest.clear()
            if done():
                break
        self.counters.num_extents_relocated += moved
        self.profile.bytes_device_to_device += copied
        capped = at_cap() and not done()
        return moved, capped
