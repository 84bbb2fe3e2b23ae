"""Torch-free definitions of the APL block format: block ids, bit-widths, byte sizes.

The planner (a torch-free service), the memory pool and every torch-side module share
these; apl_format.py re-exports them beside the torch pack/unpack/dequantise code
(docs/apl_format.md).

At b bits a block needs planes 0..b-1 (rows * cols / 8 bytes each) and one stored LUT:
LUT_3 (8 fp16 centroids a row) at 3 bits, LUT_4 (16 centroids and the outer cells' extent,
17 fp16 a row) at 4 bits and above, where the 5-8-bit values are derived from LUT_4
(apl_format.expand_lut):
    bytes(b) = rows * cols * b / 8 + rows * lut_entries(b) * 2
"""

from __future__ import annotations

import re
from typing import NamedTuple

MIN_BITS, MAX_BITS = 3, 8
BIT_WIDTHS = tuple(range(MIN_BITS, MAX_BITS + 1))
# The widest stored LUT: above it a width's values come from LUT_4's cells (apl_format.expand_lut),
# so LUT bytes stop growing with 2^bits (8 bits: 32 bytes a row, 2.3% of a 1408-column row's planes).
BASE_LUT_BITS = 4
LUT_WIDTHS = tuple(range(MIN_BITS, BASE_LUT_BITS + 1))  # the stored LUTs: LUT_3, LUT_4
MODULES = ("gate_up", "down")
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


def lut_width(bits: int) -> int:
    """The stored LUT a block at `bits` reads: LUT_3 at 3 bits, LUT_4 from 4 bits up."""
    check_bits(bits)
    return min(bits, BASE_LUT_BITS)


def lut_entries(bits: int) -> int:
    """fp16 entries a row of the stored LUT a block at `bits` reads: LUT_3's 8 centroids, or
    LUT_4's 16 and the extent of its outer cells (so outliers keep their 5-8-bit precision)."""
    width = lut_width(bits)
    return (1 << width) + (width == BASE_LUT_BITS)


def lut_bytes(rows: int, bits: int) -> int:
    """Bytes of the LUT a block at `bits` keeps on the GPU (fp16 entries)."""
    return rows * lut_entries(bits) * 2


def block_bytes(rows: int, cols: int, bits: int) -> int:
    """Bytes a block needs on the GPU at `bits`: planes 0..bits-1 plus its stored LUT."""
    check_bits(bits)
    return bits * plane_bytes(rows, cols) + lut_bytes(rows, bits)


def check_bits(bits: int) -> None:
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bit-width must be in {MIN_BITS}..{MAX_BITS}, got {bits}")


def check_shape(rows: int, cols: int) -> None:
    if cols % COL_ALIGN:
        raise ValueError(f"APL blocks need cols % {COL_ALIGN} == 0, got {rows}x{cols}")
