"""The Any-Precision (APL) bit-plane format of one expert linear block.

This module is the single definition of the format; the quantizer writes it, the torch
reference dequantises it, and the CUDA kernel reads it (docs/apl_format.md).

A block is a [rows, cols] weight matrix (`gate_up`: [2I, H], `down`: [H, I]). Every
weight has an 8-bit code; its b-bit code (3 <= b <= 8) is the top b bits of the 8-bit
code (nested quantisation). Storage:

- 8 bit-planes, plane p (0 = most significant) holds bit 7-p of every code, packed
  as uint8 [rows, cols/8]: byte j of a row holds columns 8j..8j+7, column 8j+i in bit i
  (LSB first). Read as little-endian uint32, word w holds columns 32w..32w+31 with
  column 32w+i in bit i. cols must be a multiple of 32.
- per output row two stored LUTs, fp16: LUT_3 [rows, 8] (centroids) and LUT_4 [rows, 17]
  (16 centroids, then the extent e of the outer cells).
- from 5 bits up the values are derived from LUT_4 (`expand_lut`): a b-bit code is a 4-bit
  code p and b-4 refinement bits j, and its value is the centre of sub-interval j of the
  2^(b-4) equal parts of p's cell, the cell being [midpoint to p's lower neighbour, midpoint
  to its upper one], the outer cells reaching e beyond their centroid (to the row's extremes).
  So an 8-bit row carries 34 LUT bytes, not 512. The value is computed as the kernels compute
  it without a table: one fused multiply-add in the weights' dtype (`cell_affine`).

At b bits a block needs planes 0..b-1 and LUT_min(b, 4) only:
    bytes(b) = rows * cols * b / 8 + rows * lut_entries(b) * 2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.format.blocks import (  # noqa: F401 - re-exported: the format's one definition
    BASE_LUT_BITS, BIT_WIDTHS, COL_ALIGN, LUT_WIDTHS, MAX_BITS, MIN_BITS, MODULES, BlockId, block_bytes,
    check_bits, check_shape, lut_bytes, lut_entries, lut_width, plane_bytes,
)

LUT_DTYPE = torch.float16


_BIT_WEIGHTS = 1 << torch.arange(8, dtype=torch.int32)  # bit i of a byte <- column 8j+i


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes uint8 [rows, cols] -> planes uint8 [8, rows, cols/8] (plane 0 = MSB)."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    shifts = torch.arange(7, -1, -1, device=codes.device, dtype=torch.int32)  # plane p <- bit 7-p
    bits = (codes.to(torch.int32)[None] >> shifts[:, None, None]) & 1  # [8, R, C]
    grouped = bits.view(8, rows, cols // 8, 8)
    packed = (grouped * _BIT_WEIGHTS.to(codes.device)).sum(-1)
    return packed.to(torch.uint8)


def unpack_codes(planes: torch.Tensor, bits: int) -> torch.Tensor:
    """planes uint8 [>=bits, rows, cols/8] -> b-bit codes int64 [rows, cols] (top `bits` bits)."""
    check_bits(bits)
    _, rows, packed_cols = planes.shape
    weights = _BIT_WEIGHTS.to(planes.device)
    bit_values = (planes[:bits].to(torch.int32)[..., None] & weights) != 0  # [b, R, C/8, 8]
    bit_values = bit_values.reshape(bits, rows, packed_cols * 8).to(torch.int64)
    codes = torch.zeros(rows, packed_cols * 8, dtype=torch.int64, device=planes.device)
    for p in range(bits):
        codes = (codes << 1) | bit_values[p]
    return codes


def cell_bounds(lut4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LUT_4 [R, 17] -> each 4-bit cell's (low, high) bounds, fp32 [R, 16] each.

    Inner bounds are midpoints between neighbouring centroids; the outer cells reach the
    extent (entry 16) beyond their centroid. Every step is one fp32 rounding, in the order
    the kernel's `lut_cell` computes it, so both derive bit-identical values.
    """
    lut = lut4.float()
    centroids, extent = lut[:, :16], lut[:, 16:]
    mids = (centroids[:, :-1] + centroids[:, 1:]) * 0.5
    low = torch.cat([centroids[:, :1] - extent, mids], dim=1)
    high = torch.cat([mids, centroids[:, -1:] + extent], dim=1)
    return low, high


def sub_cell_fractions(bits: int, device=None) -> torch.Tensor:
    """Centres of the 2^(bits-4) equal sub-intervals of a cell, as fractions (exact in fp32)."""
    n = 1 << (bits - BASE_LUT_BITS)
    return (2 * torch.arange(n, dtype=torch.float32, device=device) + 1) / (2 * n)


def cell_affine(lut4: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """LUT_4 [R, 17] -> each cell's (offset, width) in `dtype` [R, 16] each, such that code
    p << s | j (s = bits - 4) has the value offset_p + width_p * (1 + j / 2^s).

    1 + j / 2^s is exact in fp16 and bf16 and costs the kernels one bitwise OR of the refinement
    bits into the exponent of 1.0; offset_p = low_p - width_p * (1 - 2^-(s+1)) puts the value at
    the centre of sub-interval j. Both are computed in fp32 (one rounding a step, the kernels'
    order) and rounded once to `dtype`.
    """
    low, high = cell_bounds(lut4)
    width = high - low
    offset = low + width * -(1 - 2.0 ** -(bits - BASE_LUT_BITS + 1))
    return offset.to(dtype), width.to(dtype)


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 values -> `dtype` with one round-to-nearest-even (torch's own fp64 -> bf16
    conversion rounds twice, through fp32): the significand is rounded at its own binade,
    subnormals included, by scaling with powers of two (exact) and torch.round (ties to even)."""
    info = torch.finfo(dtype)
    precision = {torch.float16: 11, torch.bfloat16: 8}[dtype]
    min_exponent = int(torch.tensor(info.tiny, dtype=torch.float64).log2().round()) + 1  # frexp's exponent of tiny
    _, exponent = torch.frexp(values)
    ulp_exponent = torch.clamp(exponent, min=min_exponent) - precision
    rounded = torch.ldexp(torch.round(torch.ldexp(values, -ulp_exponent)), ulp_exponent.to(values.dtype))
    return rounded.to(dtype)  # exact: the value is representable


def expand_lut(lut: torch.Tensor, bits: int, dtype: torch.dtype = LUT_DTYPE) -> torch.Tensor:
    """The stored LUT of a block at `bits` -> its 2^bits values in `dtype` (fp16 or bf16),
    [R, 2^bits].

    Up to 4 bits the stored LUT is the table (rounded to `dtype`); above, value(p << s | j) =
    offset_p + width_p * (1 + j / 2^s) (cell_affine) with one rounding to `dtype`, as a fused
    multiply-add computes it: offset and width are `dtype` values and the product is exact in
    fp64, so the sum is rounded once (round_to).
    """
    rows = lut.shape[0]
    if lut.dim() != 2 or lut.shape[1] != lut_entries(bits):
        raise ValueError(f"LUT for {bits} bits must be [rows, {lut_entries(bits)}], got {tuple(lut.shape)}")
    if bits <= BASE_LUT_BITS:
        return lut[:, :1 << bits].to(dtype)
    offset, width = cell_affine(lut, bits, dtype)
    n = 1 << (bits - BASE_LUT_BITS)
    fraction = 1 + torch.arange(n, dtype=torch.float64, device=lut.device) / n
    values = offset.double()[:, :, None] + width.double()[:, :, None] * fraction
    return round_to(values.reshape(rows, 1 << bits), dtype)


def with_extent(centroids4: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """LUT_4's centroids [..., R, 16] and the rows' weights [..., R, C] -> the stored LUT_4
    [..., R, 17] (fp16): the extent is how far the row's extremes lie beyond the outer
    centroids (the larger side), so the outer cells' 5-8-bit values reach every weight."""
    c = centroids4.to(LUT_DTYPE).float()
    w = w.float()
    extent = torch.maximum(c[..., :1] - w.amin(dim=-1, keepdim=True),
                           w.amax(dim=-1, keepdim=True) - c[..., -1:]).clamp_min(0)
    return torch.cat([c, extent], dim=-1).to(LUT_DTYPE)


def refinement_bits(w: torch.Tensor, codes4: torch.Tensor, lut4: torch.Tensor) -> torch.Tensor:
    """w [R, C], its 4-bit codes and the stored fp16 LUT_4 -> the 4 low bits of every weight's
    8-bit code: which 1/16 of its 4-bit cell it lies in (cell_bounds), clamped into the cell.
    Floor of a uniform grid nests, so the top b bits pick the nearest b-bit value in the cell."""
    low, high = cell_bounds(lut4)
    w = w.float()
    low, width = torch.gather(low, 1, codes4), torch.gather(high - low, 1, codes4)
    steps = 1 << (MAX_BITS - BASE_LUT_BITS)
    position = torch.where(width > 0, (w - low) / width.clamp_min(1e-30), torch.zeros_like(w))
    return torch.floor(position * steps).clamp(0, steps - 1).long()


def dequantize(planes: torch.Tensor, lut: torch.Tensor, bits: int, dtype: torch.dtype = LUT_DTYPE) -> torch.Tensor:
    """The reference dequantisation: W[r, c] = expand_lut(LUT, bits, dtype)[r, code_bits[r, c]],
    `lut` being the block's stored LUT at `bits` (LUT_3 or LUT_4)."""
    codes = unpack_codes(planes, bits)
    if lut.shape[0] != codes.shape[0]:
        raise ValueError(f"LUT has {lut.shape[0]} rows, the planes {codes.shape[0]}")
    return torch.gather(expand_lut(lut, bits, dtype), 1, codes)


@dataclass
class APLBlock:
    """Every plane and every LUT of one block (what pinned CPU memory holds)."""

    rows: int
    cols: int
    planes: torch.Tensor  # uint8 [8, rows, cols/8]
    luts: dict[int, torch.Tensor]  # stored LUT width (3, 4) -> fp16 [rows, lut_entries(width)]

    def __post_init__(self):
        check_shape(self.rows, self.cols)
        if tuple(self.planes.shape) != (8, self.rows, self.cols // 8) or self.planes.dtype != torch.uint8:
            raise ValueError(f"planes must be uint8 [8, {self.rows}, {self.cols // 8}], got "
                             f"{self.planes.dtype} {tuple(self.planes.shape)}")
        if set(self.luts) != set(LUT_WIDTHS):
            raise ValueError(f"an APL block stores LUTs {list(LUT_WIDTHS)}, got {sorted(self.luts)}")
        for width, lut in self.luts.items():
            if tuple(lut.shape) != (self.rows, lut_entries(width)):
                raise ValueError(f"LUT_{width} must be [{self.rows}, {lut_entries(width)}], got {tuple(lut.shape)}")

    def nbytes(self, bits: int) -> int:
        return block_bytes(self.rows, self.cols, bits)

    def lut(self, bits: int) -> torch.Tensor:
        """The stored LUT a block at `bits` reads (LUT_3 or LUT_4)."""
        return self.luts[lut_width(bits)]

    def dequantize(self, bits: int, dtype: torch.dtype = LUT_DTYPE) -> torch.Tensor:
        return dequantize(self.planes, self.lut(bits), bits, dtype)
