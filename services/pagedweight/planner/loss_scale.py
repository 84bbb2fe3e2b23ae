"""Loss calibration of the sensitivity tables: one scale per (layer, module) group.

S_i(b) is the Hessian-weighted squared error of block i's *own output*. Blocks of
different modules live in different spaces: a `down` error lands in the hidden state,
a `gate_up` error lands in the intermediate space and reaches the hidden state only
through silu(gate) * up and W_down, and a late layer's error meets fewer layers than an
early one's. So S ranks blocks well within a group but not across groups: on
tiny-mixtral, S(3) of gate_up blocks is ~10x that of down blocks, while lowering a
layer's gate_up blocks to 3 bits costs the model less than lowering its down blocks.

The fix, measured once offline on calibration text (offline/group_scales.py runs the
model; this module only holds and applies the result): for every group g = (layer, module),
lower all its blocks to 3 bits (everything else at 8) and measure the damage as the mean
KL divergence from the all-8-bit model's next-token distribution (a low-noise damage
measure: unlike a perplexity difference it is never negative by chance). Then
    scale_g = KL_g / sum over i in g of m_i * (S_i(3) - S_i(8))
with m_i the calibration routing multiplier of block i's expert, and the planner uses
scale_g * S_i(b): the table keeps S's ranking inside a group and gets loss units across
groups. Group scales are floored at a small fraction of the median so a group whose
measured KL is ~0 is still cheap, not free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedweight.common.errors import UserError
from pagedweight.common.json_files import read_json_object
from pagedweight.planner.tables import BlockTable


@dataclass
class GroupScales:
    scales: dict[str, float]  # "L3.gate_up" -> scale (loss units per S unit)
    kl: dict[str, float]  # "L3.gate_up" -> measured mean KL at 3 bits (nats per token)
    num_tokens: int
    sensitivity: str = "sensitivity"  # which artifact table the scales calibrate

    def to_json(self) -> dict:
        return {"scales": self.scales, "kl_at_3_bits": self.kl, "num_tokens": self.num_tokens,
                "method": "KL(8-bit || group at 3 bits) / sum m_i (S_i(3) - S_i(8))"}

    @classmethod
    def from_json(cls, raw: dict, where: str = "planner scales") -> "GroupScales":
        """The file's (or the artifact's `planner_scales` entry's) dict; KeyError etc. if
        malformed, UserError for a NaN or negative value."""
        scales = cls({k: float(v) for k, v in raw["scales"].items()},
                     {k: float(v) for k, v in raw.get("kl_at_3_bits", {}).items()},
                     int(raw.get("num_tokens", 0)), str(raw.get("sensitivity", "sensitivity")))
        for key, value in [*scales.scales.items(), *scales.kl.items()]:
            if not (math.isfinite(value) and value >= 0):  # a NaN or negative scale inverts the ranking
                raise UserError(f"{where}: scale of {key[:40]!r} must be a finite number >= 0, got {value}")
        return scales

    @classmethod
    def read(cls, path: str | Path) -> "GroupScales":
        raw = read_json_object(path, "planner scales file")
        try:
            return cls.from_json(raw, str(path))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise UserError(f"{path}: not a planner scales file ({str(err)[:120]})") from None


def group_key(layer: int, module: str) -> str:
    return f"L{layer}.{module}"


def apply_group_scales(table: BlockTable, scales: GroupScales) -> BlockTable:
    """A copy of the table whose S is multiplied by its group's scale."""
    keys = [group_key(b.layer, b.module) for b in table.block_ids]
    missing = sorted(set(keys) - set(scales.scales))
    if missing:
        raise UserError(f"planner scales lack group {missing[0]} ({len(missing)} groups missing)")
    factor = np.array([scales.scales[k] for k in keys])
    return BlockTable(table.block_ids, table.nbytes, table.sensitivity * factor[:, None],
                      table.num_layers, table.num_experts, table.calib_mass, table.calib_share)
