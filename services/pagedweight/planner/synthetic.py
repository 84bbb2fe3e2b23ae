"""Synthetic block tables at real model sizes, for the speed benchmark and the tests.

Sensitivities follow S_i(b) = s_i * numel_i * 4^-b * (1 + small noise): s_i log-normal
(blocks differ by orders of magnitude, as measured tables do), 4^-b the squared step of a
b-bit grid. Routing mass is log-normal per expert, normalised per layer.
"""

from __future__ import annotations

import numpy as np

from pagedweight.planner.tables import BlockTable
from pagedweight.format.blocks import BIT_WIDTHS, MODULES, BlockId

# (num_layers, num_experts, hidden, expert_intermediate, top_k)
QWEN15_MOE_A27B = (24, 60, 2048, 1408, 4)
MIXTRAL_8X7B = (32, 8, 4096, 14336, 2)


def synthetic_table(num_layers: int, num_experts: int, hidden: int, intermediate: int,
                    top_k: int = 2, seed: int = 0) -> BlockTable:
    rng = np.random.default_rng(seed)
    block_ids, shapes = [], []
    for layer in range(num_layers):
        for expert in range(num_experts):
            for module in MODULES:
                block_ids.append(BlockId(layer, expert, module))
                shapes.append((2 * intermediate, hidden) if module == "gate_up" else (hidden, intermediate))
    numel = np.array([r * c for r, c in shapes], dtype=np.float64)
    scale = rng.lognormal(0.0, 1.0, size=len(shapes))
    widths = np.array(BIT_WIDTHS, dtype=np.float64)
    noise = 1.0 + 0.05 * rng.standard_normal((len(shapes), len(widths)))
    sensitivity = (scale * numel * 1e-6)[:, None] * np.power(4.0, -widths)[None, :] * noise
    mass = rng.lognormal(0.0, 0.8, size=(num_layers, num_experts))
    mass /= mass.sum(axis=1, keepdims=True)
    share = np.minimum(mass * top_k, 1.0)
    return BlockTable.from_shapes(block_ids, shapes, sensitivity, num_layers, num_experts,
                                  calib_mass=mass, calib_share=share)
