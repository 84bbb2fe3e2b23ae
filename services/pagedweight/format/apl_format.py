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

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

MIN_BITS, MAX_BITS = 3, 8
BIT_WIDTHS = tuple(range(MIN_BITS, MAX_BITS + 1))
MODULES = ("gate_up", "down")
LUT_DTYPE = torch.float16
COL_ALIGN = 32  # columns per uint32 word of a plane


class BlockId(NamedTuple):
    """One expert linear block: (layer, expert, module)."""

    layer: int
    expert: int
    module: str  # "gate_up" or "down"

    def key(self) -> str:
        """Stable string form used in files and JSON: 'L3.E5.gate_up'."""
        return f"L{self.layer}.E{self.expert}.{self.module}"

    @classmethod
    def parse(cls, key: str) -> "BlockId":
        """The inverse of `key()`, and only of it: 'L 0', 'L+0', 'L00' or non-ASCII digits
        would all be layer 0 to `int()` and silently override each other in a bits file."""
        match = _BLOCK_KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"not a block key: {repr(key)[:60]} (expected like 'L3.E5.gate_up')")
        return cls(int(match.group(1)), int(match.group(2)), match.group(3))


# canonical decimal: ASCII digits, no sign, no leading zero, at most 9 digits (a huge
# number is not a layer, and int() refuses strings past 4300 digits with its own error)
_INDEX = r"(0|[1-9][0-9]{0,8})"
_BLOCK_KEY = re.compile(rf"L{_INDEX}\.E{_INDEX}\.(" + "|".join(MODULES) + ")")


def plane_bytes(rows: int, cols: int) -> int:
    return rows * cols // 8


def lut_bytes(rows: int, bits: int) -> int:
    return rows * (1 << bits) * 2


def block_bytes(rows: int, cols: int, bits: int) -> int:
    """Bytes a block needs on the GPU at `bits`: planes 0..bits-1 plus LUT_bits."""
    check_bits(bits)
    return bits * plane_bytes(rows, cols) + lut_bytes(rows, bits)


def check_bits(bits: int) -> None:
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bit-width must be in {MIN_BITS}..{MAX_BITS}, got {bits}")


def check_shape(rows: int, cols: int) -> None:
    if cols % COL_ALIGN:
        raise ValueError(f"APL blocks need cols % {COL_ALIGN} == 0, got {rows}x{cols}")


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
