"""APL blocks without calibration: for tests and memory benchmarks, not for quality.

The real quantizer (weighted k-means) lives in services/pagedweight/offline. These helpers
make valid APL blocks fast: `nested_uniform_block` quantises a weight matrix with
per-row min-max uniform 8-bit codes (whose top b bits are the b-bit codes, so nesting
holds) and LUT_3 / LUT_4 holding the centre of each bucket (the 5-8-bit values the format
derives from LUT_4's cells are then the uniform grid's own centres); `random_blocks` fills a
model's shape with the kernels' `random_block` (random codes, nested sorted LUTs).
"""

from __future__ import annotations

import torch

from pagedweight_kernels.synthetic import random_block
from pagedweight.format.apl_format import LUT_DTYPE, LUT_WIDTHS, MODULES, APLBlock, BlockId, pack_planes, with_extent


def nested_uniform_rows(w: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """w [..., rows, cols], on its own device -> (8-bit codes uint8 [..., rows, cols],
    {3: LUT_3 [..., rows, 8], 4: LUT_4 [..., rows, 17]}): per row, 256 equal buckets of
    min..max and every b-bit bucket's centre."""
    x = w.float()
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    step = (hi - lo).clamp_min(1e-8) / 256  # 256 equal 8-bit buckets per row
    codes = ((x - lo) / step).floor_().clamp_(0, 255).to(torch.uint8)
    luts = {}
    for bits in LUT_WIDTHS:
        width = 1 << (8 - bits)  # 8-bit buckets per b-bit bucket
        centres = (torch.arange(1 << bits, device=x.device, dtype=torch.float32) + 0.5) * width
        luts[bits] = (lo + centres * step).to(LUT_DTYPE)
    luts[4] = with_extent(luts[4], x)
    return codes, luts


def nested_uniform_block(weight: torch.Tensor) -> APLBlock:
    """weight [rows, cols] -> APLBlock with min-max uniform nested codes."""
    codes, luts = nested_uniform_rows(weight.detach().cpu())
    return APLBlock(weight.shape[0], weight.shape[1], pack_planes(codes), luts)


def blocks_from_model(model) -> dict[BlockId, APLBlock]:
    """Every expert block of a loaded MoECausalLM (DenseExperts), nested-uniform quantised."""
    blocks = {}
    for layer, moe in enumerate(model.moe_blocks):
        for expert in range(moe.experts.num_experts):
            blocks[BlockId(layer, expert, MODULES[0])] = nested_uniform_block(moe.experts.gate_up[expert])
            blocks[BlockId(layer, expert, MODULES[1])] = nested_uniform_block(moe.experts.down[expert])
    return blocks


def random_blocks(num_layers: int, num_experts: int, hidden: int, intermediate: int, seed: int = 0):
    """Synthetic blocks of a model's shape (gate_up [2I, H], down [H, I])."""
    gen = torch.Generator().manual_seed(seed)
    blocks = {}
    for layer in range(num_layers):
        for expert in range(num_experts):
            blocks[BlockId(layer, expert, "gate_up")] = random_block(2 * intermediate, hidden, gen)
            blocks[BlockId(layer, expert, "down")] = random_block(hidden, intermediate, gen)
    return blocks
