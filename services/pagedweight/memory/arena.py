"""The physical half of the memory pool: one device tensor cut into pages.

Why one arena: with the PyTorch caching allocator, a freed plane goes back to the
allocator's cache, not necessarily to the KV cache; the device's reserved memory then
grows with every shift of the split. Here the worker makes ONE uint8 tensor of (budget
minus other weights and workspace) bytes at start-up and never asks the allocator for
more: bit-planes, LUTs and KV blocks are all views of page runs in it, so bytes freed
by lowering a block are the very bytes the next KV block uses (docs/memory_pool.md).

Allocation: contiguous runs of fixed-size pages, first fit over a sorted list of free
runs that coalesce on free. Weights are placed from the bottom of the arena and KV
blocks from the top, so the two kinds do not interleave more than they must; the
weight pager compacts weight runs downwards (`WeightPager`) when freed plane holes are
too small for a KV block. Every page handed out is charged, rounded to whole pages, to
the `MemoryPool` under the caller's kind: the pool's accounting is the arena's use.

KV blocks: the KV cache allocates its blocks with kind KV_USED/KV_FREE and addresses
them by `Extent.first_page`; `block_view` gives a tensor whose row p is the block
starting at page p, so block tables can index it directly.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

import torch

from pagedweight.memory.pool import KV_KINDS, BudgetExceeded, MemoryPool

# Small enough that rounding planes and LUTs of tiny models to pages wastes little, large
# enough (a multiple of 256) that every run is aligned for vector loads.
DEFAULT_PAGE_BYTES = 1024


class ArenaFragmented(RuntimeError):
    """The pool has the bytes but no contiguous run of pages is long enough."""


@dataclass(frozen=True)
class Extent:
    """A run of pages handed out for one plane, one LUT or one KV block."""

    first_page: int
    num_pages: int
    num_bytes: int  # bytes asked for (<= num_pages * page_bytes)
    kind: str  # the pool kind its pages are charged to


class Arena:
    def __init__(self, pool: MemoryPool, capacity_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES,
                 device: torch.device | str = "cpu"):
        if page_bytes <= 0 or page_bytes % 256:
            raise ValueError(f"page_bytes must be a positive multiple of 256, got {page_bytes}")
        if capacity_bytes > pool.free_bytes:
            raise BudgetExceeded(f"an arena of {capacity_bytes} bytes does not fit the pool's "
                                 f"{pool.free_bytes} free bytes")
        self.pool = pool
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.device = torch.device(device)
        self.storage = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        self._free_starts: list[int] = [0] if self.num_pages else []  # sorted starts of free runs
        self._free_len: dict[int, int] = {0: self.num_pages} if self.num_pages else {}  # start -> pages
        self._live: dict[int, Extent] = {}  # first_page -> extent
        self.last_kv_bytes: int | None = None  # size of the latest KV allocation (the KV block size)
        self._fit_pages = 0  # num_fitting's size, counted incrementally (0: none yet)
        self._fit_count = 0  # allocations of _fit_pages the free runs hold
        self._lock = threading.Lock()

    @classmethod
    def from_pool(cls, pool: MemoryPool, page_bytes: int = DEFAULT_PAGE_BYTES, device="cpu") -> "Arena":
        """An arena of everything the pool has left (charge other weights and the workspace first)."""
        return cls(pool, pool.free_bytes - pool.free_bytes % page_bytes, page_bytes, device)

    # ---- allocation -------------------------------------------------------------------
    def pages_for(self, num_bytes: int) -> int:
        return max(1, math.ceil(num_bytes / self.page_bytes))

    def charged_bytes(self, num_bytes: int) -> int:
        """What an allocation of `num_bytes` costs the pool (whole pages)."""
        return self.pages_for(num_bytes) * self.page_bytes

    def can_allocate(self, kind: str, num_bytes: int) -> bool:
        with self._lock:
            num_pages = self.pages_for(num_bytes)
            return (self.pool.can_allocate(kind, num_pages * self.page_bytes)
                    and self._find_run(num_pages, from_top=kind in KV_KINDS) is not None)

    def allocate(self, kind: str, num_bytes: int) -> Extent:
        """A run of pages for `num_bytes`, charged to `kind`. Raises BudgetExceeded when
        the pool lacks the bytes, ArenaFragmented when no run is long enough."""
        with self._lock:
            num_pages = self.pages_for(num_bytes)
            self.pool.allocate(kind, num_pages * self.page_bytes)  # raises before any change
            start = self._find_run(num_pages, from_top=kind in KV_KINDS)
            if start is None:
                self.pool.free(kind, num_pages * self.page_bytes)
                raise ArenaFragmented(f"no run of {num_pages} free pages for {kind} "
                                      f"({self.num_free_pages} pages free, longest run {self.largest_free_run()})")
            self._take(start, num_pages)
            extent = Extent(start, num_pages, num_bytes, kind)
            self._live[start] = extent
            if kind in KV_KINDS:
                self.last_kv_bytes = num_bytes
            return extent

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._live.get(extent.first_page) != extent:
                raise ValueError(f"freeing an extent the arena did not hand out (or freed twice): {extent}")
            del self._live[extent.first_page]
            self.pool.free(extent.kind, extent.num_pages * self.page_bytes)
            self._give_back(extent.first_page, extent.num_pages)

    def relabel(self, extent: Extent, kind: str) -> Extent:
        """Charge an extent's pages to another kind (a commit: transit -> expert@b)."""
        return self.relabel_many([extent], kind)[0]

    def relabel_many(self, extents: list[Extent], kind: str) -> list[Extent]:
        """`relabel` for several extents (one pool update per source kind)."""
        with self._lock:
            moved: dict[str, int] = {}  # source kind -> bytes
            for x in extents:
                if self._live.get(x.first_page) != x:
                    raise ValueError(f"relabelling an extent the arena does not hold: {x}")
                moved[x.kind] = moved.get(x.kind, 0) + x.num_pages * self.page_bytes
            for src, num_bytes in moved.items():
                self.pool.move(src, kind, num_bytes)
            new = [Extent(x.first_page, x.num_pages, x.num_bytes, kind) for x in extents]
            for x in new:
                self._live[x.first_page] = x
            return new

    def slide_down(self, extent: Extent) -> Extent | None:
        """Move a live extent down onto the free run that ends where it starts, bytes
        included, and return it at its new place (None: the page below it is not free).

        Compaction's way past holes smaller than any extent: a block lowered from 4 to 3
        bits frees LUT_4 pages that its LUT_3 only partly refills, and such one-page holes
        scattered between weight extents hold no KV tile and no other extent. Sliding each
        extent onto the hole below it carries the holes up to the KV region. Source and
        destination may overlap, so the bytes go through a copy of the extent."""
        with self._lock:
            if self._live.get(extent.first_page) != extent:
                raise ValueError(f"sliding an extent the arena does not hold: {extent}")
            i = bisect.bisect_left(self._free_starts, extent.first_page) - 1
            if i < 0:
                return None
            below = self._free_starts[i]
            if below + self._free_len[below] != extent.first_page:
                return None
            drop = extent.first_page - below
            size = extent.num_pages * self.page_bytes
            src = extent.first_page * self.page_bytes
            dst = below * self.page_bytes
            self.storage[dst: dst + size].copy_(self.storage[src: src + size].clone())
            self._take(below, drop)  # the hole below, now the extent's first pages
            self._give_back(below + extent.num_pages, drop)  # its last pages' old place
            del self._live[extent.first_page]
            moved = Extent(below, extent.num_pages, extent.num_bytes, extent.kind)
            self._live[below] = moved
            return moved

    # ---- views ------------------------------------------------------------------------
    def view(self, extent: Extent, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The extent's bytes as a tensor of `dtype` and `shape` (no copy)."""
        offset = extent.first_page * self.page_bytes
        num_bytes = math.prod(shape) * dtype.itemsize
        if num_bytes > extent.num_pages * self.page_bytes:
            raise ValueError(f"a view of {num_bytes} bytes does not fit {extent}")
        return self.storage[offset: offset + num_bytes].view(dtype).view(shape)

    def block_view(self, dtype: torch.dtype, block_shape: tuple[int, ...]) -> torch.Tensor:
        """All same-size blocks at once: row p is the block of `block_shape` starting at page p.

        Rows overlap (consecutive rows are one page apart); index only with the
        first_page of live extents. Lets a KV cache gather blocks by block table."""
        elem = dtype.itemsize
        block_bytes = math.prod(block_shape) * elem
        if self.page_bytes % elem:
            raise ValueError(f"page size {self.page_bytes} is not a multiple of {dtype}'s size")
        num_rows = self.num_pages - self.pages_for(block_bytes) + 1
        inner = torch.empty(block_shape, dtype=dtype, device="meta").stride()
        flat = self.storage.view(dtype)
        return flat.as_strided((max(num_rows, 0), *block_shape), (self.page_bytes // elem, *inner))

    # ---- state ------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return sum(self._free_len.values())

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - self.num_free_pages) * self.page_bytes

    def has_lower_run(self, num_pages: int, below_page: int) -> bool:
        """Whether a bottom-first allocation of `num_pages` would land below `below_page`."""
        with self._lock:
            start = self._find_run(num_pages, from_top=False)
            return start is not None and start < below_page

    def lowest_fit(self, num_pages: int) -> int | None:
        """First page where a bottom-first allocation of `num_pages` would land (None: no run fits)."""
        with self._lock:
            return self._find_run(num_pages, from_top=False)

    def num_fitting(self, num_bytes: int) -> int:
        """How many allocations of `num_bytes` the free runs could hold right now."""
        with self._lock:
            num_pages = self.pages_for(num_bytes)
            if num_pages != self._fit_pages:  # start counting this size on every run change
                self._fit_pages = num_pages
                self._fit_count = sum(length // num_pages for length in self._free_len.values())
            return self._fit_count

    def largest_free_run(self) -> int:
        return max(self._free_len.values(), default=0)

    def live_extents(self) -> list[Extent]:
        with self._lock:
            return sorted(self._live.values(), key=lambda e: e.first_page)

    def check_consistent(self) -> None:
        """Free runs and live extents tile the arena exactly (used by tests)."""
        spans = [(s, self._free_len[s], None) for s in self._free_starts]
        spans += [(e.first_page, e.num_pages, e) for e in self._live.values()]
        spans.sort(key=lambda s: s[0])
        pos = 0
        for start, length, _ in spans:
            assert start == pos, f"gap or overlap at page {pos} (next span starts at {start})"
            pos += length
        assert pos == self.num_pages, f"spans cover {pos} of {self.num_pages} pages"
        if self._fit_pages:
            assert self._fit_count == sum(n // self._fit_pages for n in self._free_len.values())

    # ---- free-run list ----------------------------------------------------------------
    def _find_run(self, num_pages: int, from_top: bool) -> int | None:
        """First page of a run of `num_pages`: lowest fit for weights, highest for KV."""
        starts = reversed(self._free_starts) if from_top else self._free_starts
        for start in starts:
            length = self._free_len[start]
            if length >= num_pages:
                return start + length - num_pages if from_top else start
        return None

    def _fits(self, length: int) -> int:
        return length // self._fit_pages if self._fit_pages else 0

    def _take(self, start: int, num_pages: int) -> None:
        i = bisect.bisect_right(self._free_starts, start) - 1
        run_start = self._free_starts[i]
        run_len = self._free_len.pop(run_start)
        self._fit_count -= self._fits(run_len)
        del self._free_starts[i]
        before, after = start - run_start, run_start + run_len - (start + num_pages)
        if before:
            self._insert_run(run_start, before)
        if after:
            self._insert_run(start + num_pages, after)

    def _give_back(self, start: int, num_pages: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == start + num_pages:  # merge right
            right_len = self._free_len.pop(self._free_starts.pop(i))
            self._fit_count -= self._fits(right_len)
            num_pages += right_len
        if i > 0 and self._free_starts[i - 1] + self._free_len[self._free_starts[i - 1]] == start:  # merge left
            left = self._free_starts[i - 1]
            self._fit_count -= self._fits(self._free_len[left])
            self._free_len[left] += num_pages
            self._fit_count += self._fits(self._free_len[left])
            return
        self._insert_run(start, num_pages)

    def _insert_run(self, start: int, num_pages: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_len[start] = num_pages
        self._fit_count += self._fits(num_pages)
