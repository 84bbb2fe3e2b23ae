"""What the planner knows about a model's expert blocks, as plain arrays.

A `BlockTable` is the planner's only view of a model: per block its true bytes at every
bit-width (LUTs included, from apl_format.block_bytes), its offline sensitivity S_i(b)
and which expert it belongs to; per expert the routing mass seen during calibration. It
holds no tensors, files or transport, so tests build one from synthetic numbers and the
adapter (services/planner/artifact.py) builds one from a paged model.

`planes_only` gives the same table with each block's bytes its bit planes alone, for budgets
stated in mean plane bits (bench/quality_budget.py).

Index convention: bit-width b lives in column b - MIN_BITS (3 bits -> column 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS, BlockId, block_bytes, plane_bytes

NUM_WIDTHS = len(BIT_WIDTHS)


@dataclass
class BlockTable:
    block_ids: list[BlockId]  # N blocks, in a fixed order every array below follows
    nbytes: np.ndarray  # int64 [N, 6]: bytes of block i at 3..8 bits
    sensitivity: np.ndarray  # float64 [N, 6]: S_i(b), non-increasing in b
    num_layers: int
    num_experts: int  # routed experts per layer
    calib_mass: np.ndarray | None = None  # float64 [L, E]: calibration gate weight per token
    calib_share: np.ndarray | None = None  # float64 [L, E]: calibration selections per token

    def __post_init__(self):
        n = len(self.block_ids)
        self.nbytes = np.asarray(self.nbytes, dtype=np.int64)
        sens = np.asarray(self.sensitivity, dtype=np.float64)
        if self.nbytes.shape != (n, NUM_WIDTHS) or sens.shape != (n, NUM_WIDTHS):
            raise ValueError(f"nbytes and sensitivity must be [{n}, {NUM_WIDTHS}], got "
                             f"{self.nbytes.shape} and {sens.shape}")
        if not np.all(np.isfinite(sens)) or np.any(sens < 0):
            raise ValueError("sensitivity must be finite and >= 0")
        if np.any(np.diff(self.nbytes, axis=1) <= 0):
            raise ValueError("nbytes must grow with the bit-width")
        # More bits never hurt in expectation (codes are nested); measured tables can be a
        # hair non-monotone from k-means noise, so clip each row to its running minimum.
        self.sensitivity = np.minimum.accumulate(sens, axis=1)
        self.layer = np.array([b.layer for b in self.block_ids], dtype=np.int64)
        expert = np.array([b.expert for b in self.block_ids], dtype=np.int64)
        if n and (self.layer.max() >= self.num_layers or expert.max() >= self.num_experts):
            raise ValueError("a block's layer or expert is outside num_layers x num_experts")
        self.expert_index = self.layer * self.num_experts + expert  # [N] flat expert id
        self.calib_mass = self._expert_array(self.calib_mass, "calib_mass")
        self.calib_share = self._expert_array(self.calib_share, "calib_share")

    def _expert_array(self, values, name: str) -> np.ndarray | None:
        if values is None:
            return None
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.num_layers, self.num_experts) or np.any(values < 0):
            raise ValueError(f"{name} must be >= 0 and [{self.num_layers}, {self.num_experts}]")
        return values

    @classmethod
    def from_shapes(cls, block_ids: list[BlockId], shapes: list[tuple[int, int]],
                    sensitivity: np.ndarray, num_layers: int, num_experts: int,
                    calib_mass: np.ndarray | None = None,
                    calib_share: np.ndarray | None = None) -> "BlockTable":
        """Bytes from each block's [rows, cols] through the one format definition."""
        return cls(list(block_ids), shape_nbytes(shapes), sensitivity, num_layers, num_experts,
                   calib_mass, calib_share)

    def planes_only(self, shapes: list[tuple[int, int]]) -> "BlockTable":
        """The same table with each block's bytes its bit planes alone (no LUTs), so a budget
        of B bytes is a budget of 8 B / (weights) mean plane bits. `shapes`: [rows, cols]
        per block, in block order."""
        if len(shapes) != self.num_blocks:
            raise ValueError(f"{len(shapes)} shapes for {self.num_blocks} blocks")
        return replace(self, nbytes=shape_nbytes(shapes, luts=False))

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def bytes_of(self, bits: np.ndarray) -> int:
        """Total bytes of a plan (bits [N], values 3..8)."""
        return int(self.nbytes[np.arange(self.num_blocks), np.asarray(bits) - MIN_BITS].sum())

    def uniform_bytes(self, bits: float) -> int:
        """Bytes of the uniform plan; a fractional width interpolates (3.5 -> half-way)."""
        low = int(np.floor(bits))
        total_low = int(self.nbytes[:, low - MIN_BITS].sum())
        if low == bits:
            return total_low
        total_high = int(self.nbytes[:, low + 1 - MIN_BITS].sum())
        return int(round(total_low + (bits - low) * (total_high - total_low)))

    def bits_map(self, bits: np.ndarray) -> dict[str, int]:
        """The plan file's form: block key -> bits."""
        return {b.key(): int(v) for b, v in zip(self.block_ids, bits)}

    def bits_from_map(self, bits_map: dict[str, int]) -> np.ndarray:
        missing = [b.key() for b in self.block_ids if b.key() not in bits_map]
        if missing:
            raise KeyError(f"bits map lacks {len(missing)} blocks, e.g. {missing[0]}")
        return np.array([bits_map[b.key()] for b in self.block_ids], dtype=np.int64)


def shape_nbytes(shapes: list[tuple[int, int]], luts: bool = True) -> np.ndarray:
    """int64 [N, 6]: bytes of blocks of these [rows, cols] at 3..8 bits, planes plus the stored
    LUT (format.blocks.block_bytes), or the planes alone (`luts` False)."""
    def one(r: int, c: int, b: int) -> int:
        return block_bytes(r, c, b) if luts else b * plane_bytes(r, c)

    return np.array([[one(r, c, b) for b in BIT_WIDTHS] for r, c in shapes],
                    dtype=np.int64).reshape(len(shapes), NUM_WIDTHS)
