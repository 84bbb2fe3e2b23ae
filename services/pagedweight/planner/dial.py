"""The operator's dial: a quality floor and a decode-latency target the planner holds to.

- `min_mean_bits` (0: off): the planner never frees expert bytes below those of every block
  at this width (`BlockTable.uniform_bytes`, a fractional width interpolated between its
  neighbours). A free request is cut to what lies above the floor; the worker's broker then
  queues or preempts for the rest, as it does when every block is at 3 bits. The floor is in
  bytes, the planner's currency: a plan at the floor holds the bytes of the uniform plan at
  that width, spread where they cut the most damage.
- `target_itl_s` (0: off): while the worker reports a recent inter-token latency above the
  target, a spend request is held: raising bits copies planes and runs wider kernels, so
  the weights take bytes back only while decode is within its target.

Set at start (`pagedweight planner --min-mean-bits --target-itl-ms`) and at run time
(the planner service's SetDial); docs/planner.md says how to choose them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedweight.format.blocks import BIT_WIDTHS
from pagedweight.planner.tables import BlockTable


@dataclass(frozen=True)
class OperatorDial:
    min_mean_bits: float = 0.0  # quality floor in mean expert bits, 3..8 (0: none)
    target_itl_s: float = 0.0  # decode latency target in seconds per token (0: none)

    def __post_init__(self):
        if not (self.min_mean_bits == 0 or BIT_WIDTHS[0] <= self.min_mean_bits <= BIT_WIDTHS[-1]):
            raise ValueError(f"min_mean_bits must be 0 (off) or in {BIT_WIDTHS[0]}..{BIT_WIDTHS[-1]}, "
                             f"got {self.min_mean_bits}")
        if not (math.isfinite(self.target_itl_s) and self.target_itl_s >= 0):
            raise ValueError(f"target_itl_s must be >= 0 (0: off), got {self.target_itl_s}")

    def floor_bytes(self, table: BlockTable) -> int:
        """Expert bytes the planner never frees below (0: no floor)."""
        return table.uniform_bytes(self.min_mean_bits) if self.min_mean_bits else 0

    def holds_spend(self, inter_token_s: float) -> bool:
        """True while a reported latency (0: none reported) is above the target."""
        return bool(self.target_itl_s) and inter_token_s > self.target_itl_s
