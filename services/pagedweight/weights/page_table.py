"""The weight page table: for every expert block, what kernels may read and where it is.

Per block i (an apl_format.BlockId) it holds the desired bit-width d_i (what the planner
wants), the committed bit-width q_i (what kernels read; 0 while the block is only on the
CPU) and the arena extents of planes 0..q_i-1 and of LUT_{q_i}. Its state is
CPU_ONLY (q_i = 0), RESIDENT, or IN_TRANSIT (resident at q_i while the page mover copies
the planes of a higher bit-width; the new extents are NOT in the entry until commit, so
no reader can reach them).

Host memory (pinned when CUDA is available) keeps every plane and every LUT of every
block for the whole run: raising copies from it, lowering never has to write back.
Only the page mover changes entries; readers use `resident_views`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pagedweight.memory.arena import Arena, Extent
from pagedweight.format.apl_format import BIT_WIDTHS, LUT_DTYPE, APLBlock, BlockId, check_bits, lut_bytes, lut_entries


class Residency(str, enum.Enum):
    CPU_ONLY = "cpu_only"
    RESIDENT = "resident"
    IN_TRANSIT = "in_transit"


_UNSETTLING = frozenset({"desired_bits", "committed_bits", "transit_bits"})  # fields `unsettled()` reads


@dataclass
class BlockPages:
    """One row of the page table."""

    block_id: BlockId
    rows: int
    cols: int
    desired_bits: int  # d_i: where the planner wants the block
    committed_bits: int = 0  # q_i: what kernels read (0 = CPU only)
    plane_extents: list[Extent] = field(default_factory=list)  # plane p -> extent, p < q_i
    lut_extent: Extent | None = None  # LUT_{q_i}
    transit_bits: int = 0  # bit-width being copied in (0 = nothing in transit)
    version: int = 0  # bumps whenever what readers see changes (commit, relocation)
    owner: PageTable | None = field(default=None, repr=False, compare=False)  # set by the table

    def __setattr__(self, name, value):
        # The table's dirty set and weighted bit sum follow every change, whoever makes it
        # (pager, mover, tests, benchmarks), so a boundary visits only the blocks that moved.
        owner = self.__dict__.get("owner")
        if owner is not None:
            if name in _UNSETTLING:
                owner._unsettled = None  # the boundary's list may change: computed again on demand
            if name == "desired_bits":
                owner.dirty.add(self.block_id)
            elif name == "committed_bits":
                owner.committed_weight_bits += (value - self.committed_bits) * self.rows * self.cols
            elif name == "version":
                owner.generation += 1
        object.__setattr__(self, name, value)

    @property
    def state(self) -> Residency:
        if self.transit_bits:
            return Residency.IN_TRANSIT
        return Residency.RESIDENT if self.committed_bits else Residency.CPU_ONLY

    @property
    def effective_bits(self) -> int:
        """Bits the block will hold once what is in flight lands."""
        return self.transit_bits or self.committed_bits

    @property
    def num_weights(self) -> int:
        return self.rows * self.cols


class PageTable:
    def __init__(self, host_blocks: dict[BlockId, APLBlock], arena: Arena, initial_desired_bits: int = 8):
        check_bits(initial_desired_bits)
        self.arena = arena
        pin = arena.device.type == "cuda"
        self.host: dict[BlockId, APLBlock] = {  # block_id -> every plane and LUT, on the host
            bid: _host_copy(block, pin) for bid, block in host_blocks.items()
        }
        self.entries: dict[BlockId, BlockPages] = {
            bid: BlockPages(bid, b.rows, b.cols, initial_desired_bits) for bid, b in self.host.items()
        }
        # Moves whenever any row's version does (never goes back): readers that cache what the
        # rows pointed at compare this one number per step instead of every row's version.
        self.generation = 0
        # Blocks that may not be at their desired bits (desired set since they last were, or
        # a copy in flight): what a step boundary visits, O(blocks changed) instead of O(all).
        self.dirty: set[BlockId] = set(self.entries)
        self.index = {bid: i for i, bid in enumerate(self.entries)}  # table order, for determinism
        self._unsettled: list[BlockPages] | None = None  # unsettled()'s answer until a block changes
        self.committed_weight_bits = 0  # sum of committed bits x weights (the mean without a scan)
        self.num_weights = sum(e.num_weights for e in self.entries.values())
        for e in self.entries.values():
            e.owner = self
        self.read_log: list[Extent] | None = None  # when a list, readers append what they read (tests)
        self.num_desired_updates = 0  # set_desired_bits calls (plans set from outside the pager)
        # kernel descriptor rows rewritten because a block's version moved, and the host
        # seconds spent on it (ArenaExperts counts them; the pager's profile reports them)
        self.num_descriptor_updates = 0
        self.descriptor_seconds = 0.0

    # ---- sizes ------------------------------------------------------------------------
    def plane_bytes(self, block_id: BlockId) -> int:
        e = self.entries[block_id]
        return e.rows * e.cols // 8

    def lut_bytes(self, block_id: BlockId, bits: int) -> int:
        return lut_bytes(self.entries[block_id].rows, bits)

    def charged_bytes(self, block_id: BlockId, bits: int) -> int:
        """Arena bytes (whole pages) a block costs at `bits`; 0 bits costs nothing."""
        if bits == 0:
            return 0
        return (bits * self.arena.charged_bytes(self.plane_bytes(block_id))
                + self.arena.charged_bytes(self.lut_bytes(block_id, bits)))

    def charged_bytes_table(self) -> dict[BlockId, dict[int, int]]:
        """block_id -> {bits -> arena bytes}: the true costs a planner should see."""
        return {bid: {b: self.charged_bytes(bid, b) for b in BIT_WIDTHS} for bid in self.entries}

    # ---- reading ----------------------------------------------------------------------
    def resident_views(self, block_id: BlockId) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        """(plane views [rows, cols/8] for p < q_i, the stored LUT's view [rows, lut_entries(q_i)], q_i).

        Only committed extents are reachable from here: an in-transit copy is never read."""
        e = self.entries[block_id]
        if not e.committed_bits:
            raise RuntimeError(f"{block_id.key()} is not resident on {self.arena.device} (CPU only)")
        planes = [self.arena.view(x, torch.uint8, (e.rows, e.cols // 8)) for x in e.plane_extents]
        lut = self.arena.view(e.lut_extent, LUT_DTYPE, (e.rows, lut_entries(e.committed_bits)))
        if self.read_log is not None:
            self.read_log.extend(e.plane_extents + [e.lut_extent])
        return planes, lut, e.committed_bits

    def committed_bits(self) -> dict[BlockId, int]:
        return {bid: e.committed_bits for bid, e in self.entries.items()}  # block_id -> bits

    def desired_bits(self) -> dict[BlockId, int]:
        return {bid: e.desired_bits for bid, e in self.entries.items()}  # block_id -> bits

    def set_desired_bits(self, plan: dict[BlockId, int]) -> None:
        self.num_desired_updates += 1  # lets the pager see a change it did not make
        for bid, bits in plan.items():
            check_bits(bits)
            self.entries[bid].desired_bits = bits

    def unsettled(self) -> list[BlockPages]:
        """The dirty blocks still off their desired bits or in transit, in table order; the
        others leave the dirty set here. Kept until a block's desired, committed or transit
        bits change: a boundary asks several times (pager sums, raise order, mover, busy)
        and would otherwise filter and sort the dirty set each time. Do not modify the list."""
        if self._unsettled is None:
            settled = [bid for bid in self.dirty if (e := self.entries[bid]).desired_bits == e.committed_bits
                       and not e.transit_bits]
            self.dirty.difference_update(settled)
            self._unsettled = [self.entries[bid] for bid in sorted(self.dirty, key=self.index.__getitem__)]
        return self._unsettled

    def mean_committed_bits(self) -> float:
        return self.committed_weight_bits / max(self.num_weights, 1)

    def resident_expert_bytes(self) -> int:
        """Arena bytes of committed planes and LUTs (what the pool's expert kinds hold)."""
        return sum(x.num_pages for e in self.entries.values()
                   for x in e.plane_extents + ([e.lut_extent] if e.lut_extent else [])) * self.arena.page_bytes


def _host_copy(block: APLBlock, pin: bool) -> APLBlock:
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu").contiguous()
        return t.pin_memory() if pin else t

    return APLBlock(block.rows, block.cols, host(block.planes), {b: host(lut) for b, lut in block.luts.items()})
