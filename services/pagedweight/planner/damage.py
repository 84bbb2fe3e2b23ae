"""The damage model: how much quality block i loses at b bits, for the traffic now running.

    D_i(b) = m_e(i) * S_i(b) * exp(w_r * clip(r_i(b), -c, c))

- S_i(b): offline sensitivity, the Hessian-weighted squared error of block i at b bits
  (the artifact's table). It measures the error of the block's output per routed token.
- m_e: the routing multiplier of block i's expert e. An expert's error reaches the model
  output in proportion to how much of its layer's output it makes, i.e. its routing mass
  (gate weight per token, moving average): m_e = clip(relative_mass_e ** routing_exponent).
  Hot experts also get a soft bit floor (PlannerConfig.hot_floors).
- r_i(b): the prompt residual, the predicted log(S_i^prompt(b) / S_i(b)) for the prompts
  now running (regression heads fitted offline on prompt features); 0 when unknown.

The cost of lowering block i from b to b-1 is D_i(b-1) - D_i(b); the greedy planner
(greedy.py) divides it by the bytes the step frees. D is made non-increasing in b.

Ablations switch one signal off: `use_routing=False` (m = 1, no hot floors),
`use_residual=False` (r = 0), `use_sensitivity=False` (S_i(b) replaced by a
sensitivity-free proxy: every weight equally important, error ~ numel * 4^-b, the
squared step of a uniform b-bit grid, scaled to the same total as S at 3 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.greedy import running
from pagedweight.planner.tables import BlockTable
from pagedweight.format.blocks import BIT_WIDTHS, MIN_BITS


@dataclass
class DamageInputs:
    """The online signals for one plan; None means 'not known' (neutral)."""

    relative_mass: np.ndarray | None = None  # [L, E]: routing mass / layer mean (1 = average)
    residual: np.ndarray | None = None  # [N] or [N, 6]: predicted log(S_prompt / S)


class DamageModel:
    def __init__(self, table: BlockTable, config: PlannerConfig = PlannerConfig(),
                 use_sensitivity: bool = True, use_routing: bool = True, use_residual: bool = True):
        self.table, self.config = table, config
        self.use_routing, self.use_residual = use_routing, use_residual
        self.base = table.sensitivity if use_sensitivity else uniform_error_proxy(table)

    def multipliers(self, inputs: DamageInputs) -> np.ndarray:
        """[N] routing multiplier of each block's expert (1 without routing information)."""
        if not self.use_routing or inputs.relative_mass is None:
            return np.ones(self.table.num_blocks)
        cfg = self.config
        rel = np.asarray(inputs.relative_mass, dtype=np.float64).reshape(-1)[self.table.expert_index]
        return np.clip(np.power(np.maximum(rel, 0.0), cfg.routing_exponent),
                       cfg.min_multiplier, cfg.max_multiplier)

    def damage(self, inputs: DamageInputs = DamageInputs()) -> np.ndarray:
        """[N, 6]: D_i(b) for b = 3..8, non-increasing in b."""
        table = self.base * self.multipliers(inputs)[:, None]
        if self.use_residual and inputs.residual is not None:
            r = np.asarray(inputs.residual, dtype=np.float64)
            r = r[:, None] if r.ndim == 1 else r
            if r.shape[0] != self.table.num_blocks:
                raise ValueError(f"residual has {r.shape[0]} rows for {self.table.num_blocks} blocks")
            clip = self.config.residual_clip
            table = table * np.exp(self.config.residual_weight * np.clip(r, -clip, clip))
        return running(np.minimum, table)

    def floors(self, inputs: DamageInputs = DamageInputs()) -> np.ndarray:
        """[N] soft bit floor of each block: config.min_bits, raised for hot experts."""
        floors = np.full(self.table.num_blocks, self.config.min_bits, dtype=np.int64)
        if not self.use_routing or inputs.relative_mass is None:
            return floors
        rel = np.asarray(inputs.relative_mass, dtype=np.float64).reshape(-1)[self.table.expert_index]
        for threshold, bits in self.config.hot_floors:
            floors = np.where(rel >= threshold, np.maximum(floors, bits), floors)
        return np.minimum(floors, self.config.max_bits)


def uniform_error_proxy(table: BlockTable) -> np.ndarray:
    """[N, 6]: numel * 4^-b, scaled so its 3-bit total equals the real table's."""
    numel = block_numel(table.nbytes)
    proxy = numel[:, None] * np.power(4.0, -np.array(BIT_WIDTHS, dtype=np.float64))[None, :]
    total_real = table.sensitivity[:, 0].sum()
    scale = total_real / proxy[:, 0].sum() if total_real > 0 else 1.0
    return proxy * scale


def block_numel(nbytes: np.ndarray) -> np.ndarray:
    """Weights per block, recovered from a byte difference of block_bytes.

    From 4 bits up a block reads the same stored LUT (LUT_4, APL format 2), so
    bytes(5) - bytes(4) is one plane: numel / 8.
    """
    return (8 * (nbytes[:, 5 - MIN_BITS] - nbytes[:, 4 - MIN_BITS])).astype(np.float64)
