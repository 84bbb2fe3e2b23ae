"""What the fused kernel reads of one MoE layer: ResidentBlock (one block's planes and LUT at its
committed width) and APLLayer (every routed expert's blocks, their descriptor rows on the GPU
and the summaries the launches are planned from).

A layer is described to the kernel by two int64 descriptor tensors on the GPU (one row per
expert, for `gate_up` and `down`): bits, LUT address and one address per plane, so every
plane may live anywhere in the memory pool and a page-table commit only rewrites a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from pagedweight_kernels.moe_reference import check_activation
from pagedweight.format.apl_format import (
    COL_ALIGN, LUT_DTYPE, MAX_BITS, APLBlock, block_bytes, check_bits, dequantize, lut_entries,
)

DESC_WIDTH = 10  # int64 per block: bits, LUT address, 8 plane addresses (the .cu's DESC_WIDTH)
DESC_BITS, DESC_LUT, DESC_PLANES = 0, 1, 2
MAX_EXPERTS = 1024  # moe_align's shared counters
GEMV_ROWS = 64  # weight rows per apl_gemv CTA (the .cu's GV_ROWS): gate_up row tiles hold 32 h columns


class APLKernelError(ValueError):
    """Arguments the fused kernel cannot take (dtype, shape, device, layout)."""


def bit_class(bits: int) -> int:
    """The decode kernel compiled for this width: 0 for 3-4 bits (LUT in registers), 1 for 5-8."""
    return 0 if bits <= 4 else 1


def widest_by_class(widths) -> dict[int, int]:
    """Bit class -> the widest of these widths in it (classes ascending), as APLLayer.classes
    holds them per projection."""
    widest: dict[int, int] = {}
    for bits in widths:
        c = bit_class(bits)
        widest[c] = max(widest.get(c, 0), bits)
    return dict(sorted(widest.items()))


def class_launches(classes: dict[int, int]) -> list[tuple[int, int]]:
    """(kernel class, widest bits for its shared LUT) per launch: the class's kernel, or the merged
    kernel (class 2) once where both are present (faster than a launch per class, docs/kernel.md)."""
    if len(classes) > 1:
        return [(2, classes[1])]
    return list(classes.items())


@dataclass
class ResidentBlock:
    """What the GPU holds of one block at its committed bit-width."""

    bits: int
    planes: list[torch.Tensor]  # planes 0..bits-1, each uint8 [rows, cols/8], contiguous, anywhere
    lut: torch.Tensor  # the stored LUT at `bits` (LUT_3, or LUT_4 from 4 bits up), fp16 [rows, lut_entries(bits)], contiguous

    def __post_init__(self):
        check_bits(self.bits)
        if len(self.planes) != self.bits:
            raise APLKernelError(f"a {self.bits}-bit block needs planes 0..{self.bits - 1}, got {len(self.planes)}")
        rows, packed = self.planes[0].shape
        for p, plane in enumerate(self.planes):
            if plane.dtype != torch.uint8 or tuple(plane.shape) != (rows, packed) or not plane.is_contiguous():
                raise APLKernelError(f"plane {p} must be contiguous uint8 [{rows}, {packed}], got "
                                     f"{plane.dtype} {tuple(plane.shape)}")
            if plane.data_ptr() % 4:
                raise APLKernelError(f"plane {p} must start on a 4-byte boundary (read as uint32 words)")
        if (packed * 8) % COL_ALIGN:
            raise APLKernelError(f"APL blocks need cols % {COL_ALIGN} == 0, got {packed * 8}")
        entries = lut_entries(self.bits)
        if self.lut.dtype != LUT_DTYPE or tuple(self.lut.shape) != (rows, entries) or not self.lut.is_contiguous():
            raise APLKernelError(f"a {self.bits}-bit block's LUT must be contiguous {LUT_DTYPE} [{rows}, {entries}], "
                                 f"got {self.lut.dtype} {tuple(self.lut.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes[0].shape[0], self.planes[0].shape[1] * 8

    @cached_property
    def aligned8(self) -> bool:
        """Every plane 8-byte aligned with an even word count per row (decode's 8-byte loads)."""
        return self.shape[1] % 64 == 0 and all(p.data_ptr() % 8 == 0 for p in self.planes)

    @cached_property
    def aligned16(self) -> bool:
        """Every plane 16-byte aligned with a word count per row divisible by 4 (the staged
        regime's 16-byte plane loads)."""
        return self.shape[1] % 128 == 0 and all(p.data_ptr() % 16 == 0 for p in self.planes)

    @property
    def device(self) -> torch.device:
        return self.lut.device

    def descriptor(self) -> list[int]:
        planes = [p.data_ptr() for p in self.planes] + [0] * (8 - self.bits)
        return [self.bits, self.lut.data_ptr(), *planes]

    def dequantize(self, dtype: torch.dtype = LUT_DTYPE) -> torch.Tensor:
        """[rows, cols] in `dtype` (fp16 or bf16) through the format's reference dequantisation."""
        return dequantize(torch.stack(self.planes), self.lut, self.bits, dtype)


def resident_block(block: APLBlock, bits: int, device) -> ResidentBlock:
    """The planes 0..bits-1 and the stored LUT a block reads at `bits`, copied to `device`."""
    planes = [block.planes[p].to(device).contiguous() for p in range(bits)]
    return ResidentBlock(bits, planes, block.lut(bits).to(device).contiguous())


@dataclass
class APLLayer:
    """All routed expert blocks of one MoE layer, as the fused kernel reads them."""

    gate_up: list[ResidentBlock]  # per expert, [2I, H] (gate rows, then up rows)
    down: list[ResidentBlock]  # per expert, [H, I]
    activation: str = "silu"  # act(gate) * up: moe_reference.ACTIVATIONS
    # True: decode launches the merged kernel with the 8-bit LUT size whatever the layer's bits
    # (stable_launches below), so a captured decode graph stays valid across bit changes
    stable_launches: bool = False
    num_experts: int = field(init=False)
    hidden: int = field(init=False)
    intermediate: int = field(init=False)
    gate_up_desc: torch.Tensor = field(init=False)  # int64 [E, DESC_WIDTH] on the blocks' device
    down_desc: torch.Tensor = field(init=False)
    max_bits: int = field(init=False)  # largest committed bit-width: sizes the kernels' shared LUTs
    # per projection: bit class -> widest committed bits in it (decode: one launch per class)
    classes: dict[str, dict[int, int]] = field(init=False)
    # per projection: every plane 8-byte aligned with an even word count (decode: 8-byte loads)
    aligned8: dict[str, bool] = field(init=False)
    # per projection: every plane 16-byte aligned, words per row divisible by 4 (staged: 16-byte loads)
    aligned16: dict[str, bool] = field(init=False)
    counters: torch.Tensor = field(init=False)  # int32 zeros: the decode kernels' last-CTA counters

    def __post_init__(self):
        check_activation(self.activation)
        self.num_experts = len(self.gate_up)
        if not 0 < self.num_experts <= MAX_EXPERTS or len(self.down) != self.num_experts:
            raise APLKernelError(f"need 1..{MAX_EXPERTS} experts with one gate_up and one down block each, "
                                 f"got {len(self.gate_up)} and {len(self.down)}")
        two_i, self.hidden = self.gate_up[0].shape
        self.intermediate = two_i // 2
        for e in range(self.num_experts):
            self._check_block(e, "gate_up", self.gate_up[e])
            self._check_block(e, "down", self.down[e])
        self.refresh()

    def _check_block(self, e: int, module: str, block: ResidentBlock):
        H, I = self.hidden, self.intermediate
        want = (2 * I, H) if module == "gate_up" else (H, I)
        if tuple(block.shape) != want:
            raise APLKernelError(f"expert {e} {module} must be {want[0]}x{want[1]}, got {block.shape}")
        if block.device != self.gate_up[0].device:
            raise APLKernelError(f"expert {e} {module} is on {block.device}, the layer on {self.gate_up[0].device}")

    @property
    def device(self) -> torch.device:
        return self.gate_up[0].device

    def set_block(self, expert: int, module: str, block: ResidentBlock):
        """Point one block at new planes/LUT (a page-table commit) and rewrite its descriptor row."""
        self.set_blocks([(expert, module, block)])

    def set_blocks(self, updates: list[tuple[int, str, ResidentBlock]]):
        """Point several blocks at new planes/LUTs and rewrite their descriptor rows: one
        stream-ordered copy per descriptor tensor and one summary for the whole batch (a row at
        a time would take a synchronising pageable copy and a walk over every block each)."""
        for expert, module, block in updates:
            self._check_block(expert, module, block)
        for module in ("gate_up", "down"):
            rows = {e: b for e, m, b in updates if m == module}  # the last update of a row wins
            if not rows:
                continue
            blocks = getattr(self, module)
            for e, b in rows.items():
                blocks[e] = b
            desc = self.gate_up_desc if module == "gate_up" else self.down_desc
            index = torch.tensor(list(rows), dtype=torch.int64)
            values = torch.tensor([b.descriptor() for b in rows.values()], dtype=torch.int64)
            if desc.is_cuda:  # pinned, so the copies queue behind the work in flight without a sync
                index, values = index.pin_memory(), values.pin_memory()
            desc.index_copy_(0, index.to(desc.device, non_blocking=True), values.to(desc.device, non_blocking=True))
        self._summarise()

    def refresh(self):
        """Rebuild both descriptor tensors from the blocks (host -> device copy)."""
        self.gate_up_desc = _descriptors(self.gate_up, self.device)
        self.down_desc = _descriptors(self.down, self.device)
        self._summarise()
        # One counter per (active expert, gate_up row tile) at most; the down launches reuse
        # them (every counter is back at zero when a launch ends). A layer runs on one stream at
        # a time, as a model's forward does.
        self.counters = torch.zeros(counter_words(self.num_experts, self.hidden, self.intermediate),
                                    dtype=torch.int32, device=self.device)

    def _summarise(self):
        self.max_bits = max(b.bits for b in self.gate_up + self.down)
        self.classes = {}
        for module in ("gate_up", "down"):
            self.classes[module] = widest_by_class(b.bits for b in getattr(self, module))
        self.aligned8 = {m: all(b.aligned8 for b in getattr(self, m)) for m in ("gate_up", "down")}
        self.aligned16 = {m: all(b.aligned16 for b in getattr(self, m)) for m in ("gate_up", "down")}

    def decode_launches(self, module: str) -> list[tuple[int, int]]:
        """(kernel class, widest bits for its shared LUT) per decode launch of one projection."""
        if self.stable_launches:
            return [(2, MAX_BITS)]
        return class_launches(self.classes[module])

    def prefill_widest_bits(self) -> int:
        """The widest bits a prefill-kernel launch accepts (its lut_log2: a block above them gives
        NaN rows): the layer's own, or MAX_BITS under stable_launches, where a captured step's
        prefill launch outlives the pager's raises (launch_signature leaves the bits out)."""
        return MAX_BITS if self.stable_launches else self.max_bits

    def launch_signature(self) -> tuple:
        """What the layer's launches bake in beyond its descriptor rows (a CUDA graph of a step
        replays them): widest bits (prefill's shared LUT), per projection the decode kernels
        launched with their LUT sizes, and the plane alignment. Coarser than the bit classes: in
        a layer with both classes one merged launch runs whatever the 3-4-bit class's widest
        width is, so a 3 <-> 4-bit move there changes nothing a graph holds.
        With stable_launches only the alignment is left: decode, tiles and staged steps launch
        the merged kernel at any bits, and a prefill launch takes MAX_BITS (prefill_widest_bits)."""
        if self.stable_launches:  # (16-byte plane alignment picks the staged instance)
            return "stable", tuple(self.aligned8.values()), tuple(self.aligned16.values())
        launches = tuple(tuple((cls, widest if cls >= 1 else 0) for cls, widest in self.decode_launches(m))
                         for m in ("gate_up", "down"))
        return self.max_bits, launches, tuple(self.aligned8.values())

    def nbytes_active(self, expert_ids) -> int:
        """Plane + LUT bytes the kernel reads for these experts at their committed bits."""
        return sum(self.nbytes_by_width(expert_ids).values())

    def nbytes_by_width(self, expert_ids) -> dict[int, int]:
        """nbytes_active split by the blocks' committed widths."""
        out: dict[int, int] = {}
        for e in expert_ids:
            for block in (self.gate_up[e], self.down[e]):
                rows, cols = block.shape
                out[block.bits] = out.get(block.bits, 0) + block_bytes(rows, cols, block.bits)
        return out


def counter_words(num_experts: int, hidden: int, intermediate: int) -> int:
    """int32 words of last-CTA counters the decode and tiles launches use: one per (active expert,
    gate_up row tile); the down launch reuses the first, one per row tile."""
    gu_tiles, dn_tiles = math.ceil(intermediate / (GEMV_ROWS // 2)), math.ceil(hidden / GEMV_ROWS)
    return max(num_experts * gu_tiles, dn_tiles)


def _descriptors(blocks: list[ResidentBlock], device) -> torch.Tensor:
    return torch.tensor([b.descriptor() for b in blocks], dtype=torch.int64).to(device)
