"""Torch-free definitions of the APL block format: block ids, bit-widths, byte sizes.

The planner (a torch-free service), the memory pool and every torch-side module share
these; apl_format.py re-exports them beside the torch pack/unpack/dequantise code
(docs/apl_format.md).

At b bits a block needs planes 0..b-1 (rows * cols / 8 bytes each) and LUT_b
(rows * 2^b fp16 centroids):
    bytes(b) = rows * cols * b / 8 + rows * 2^b * 2
"""

from __future__ import annotations

import re
from typing import NamedTuple

MIN_BITS, MAX_BITS = 3, 8
BIT_WIDTHS = tuple(range(MIN_BITS, MAX_BITS + 1))
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
