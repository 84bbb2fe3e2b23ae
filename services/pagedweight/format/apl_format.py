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
- per output row and per b in 3..8 a LUT of 2^b fp16 centroids: LUT_b [rows, 2^b].

At b bits a block needs planes 0..b-1 and LUT_b only:
    bytes(b) = rows * cols * b / 8 + rows * 2^b * 2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.format.blocks import (  # noqa: F401 - re-exported: the format's one definition
    BIT_WIDTHS, COL_ALIGN, MAX_BITS, MIN_BITS, MODULES, BlockId, block_bytes, check_bits, check_shape,
    lut_bytes, plane_bytes,
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


def dequantize(planes: torch.Tensor, lut: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference dequantisation: W[r, c] = LUT_bits[r, code_bits[r, c]] (fp16)."""
    codes = unpack_codes(planes, bits)
    if lut.shape != (codes.shape[0], 1 << bits):
        raise ValueError(f"LUT for {bits} bits must be [{codes.shape[0]}, {1 << bits}], got {tuple(lut.shape)}")
    return torch.gather(lut, 1, codes)


@dataclass
class APLBlock:
    """Every plane and every LUT of one block (what pinned CPU memory holds)."""

    rows: int
    cols: int
    planes: torch.Tensor  # uint8 [8, rows, cols/8]
    luts: dict[int, torch.Tensor]  # bits -> fp16 [rows, 2^bits]

    def __post_init__(self):
        check_shape(self.rows, self.cols)
        if tuple(self.planes.shape) != (8, self.rows, self.cols // 8) or self.planes.dtype != torch.uint8:
            raise ValueError(f"planes must be uint8 [8, {self.rows}, {self.cols // 8}], got "
                             f"{self.planes.dtype} {tuple(self.planes.shape)}")
        for bits in BIT_WIDTHS:
            lut = self.luts.get(bits)
            if lut is None or tuple(lut.shape) != (self.rows, 1 << bits):
                raise ValueError(f"LUT_{bits} must be [{self.rows}, {1 << bits}]")

    def nbytes(self, bits: int) -> int:
        return block_bytes(self.rows, self.cols, bits)

    def dequantize(self, bits: int) -> torch.Tensor:
        return dequantize(self.planes, self.luts[bits], bits)
