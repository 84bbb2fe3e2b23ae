"""Hypothesis strategies: small block tables with true APL byte counts and random sensitivities."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from pagedweight.planner.tables import BlockTable
from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId

SHAPES = [(32, 32), (64, 32), (128, 64), (256, 128), (96, 256), (512, 64)]


@st.composite
def block_tables(draw, max_experts: int = 4, max_layers: int = 3) -> BlockTable:
    num_layers = draw(st.integers(1, max_layers))
    num_experts = draw(st.integers(1, max_experts))
    seed = draw(st.integers(0, 2**31 - 1))
    return random_table(num_layers, num_experts, seed)


def random_table(num_layers: int, num_experts: int, seed: int) -> BlockTable:
    rng = np.random.default_rng(seed)
    block_ids, shapes = [], []
    for layer in range(num_layers):
        for expert in range(num_experts):
            for module in MODULES:
                block_ids.append(BlockId(layer, expert, module))
                shapes.append(SHAPES[rng.integers(len(SHAPES))])
    widths = np.array(BIT_WIDTHS, dtype=np.float64)
    # random per-step decay so the chains are not all convex (the hard case for a greedy)
    decay = rng.uniform(1.2, 6.0, size=(len(shapes), len(widths)))
    decay[:, 0] = 1.0
    sensitivity = rng.lognormal(0, 1.5, size=len(shapes))[:, None] / np.cumprod(decay, axis=1)
    mass = rng.dirichlet(np.ones(num_experts), size=num_layers)
    return BlockTable.from_shapes(block_ids, shapes, sensitivity, num_layers, num_experts, mass)


def bits_within(rng: np.random.Generator, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return rng.integers(low, high + 1)
