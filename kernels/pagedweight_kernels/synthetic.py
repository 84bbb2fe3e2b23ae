"""APL blocks for tests and benchmarks: random ones, and a simple nested quantizer.

Neither is the project's quantizer (services/offline does the sensitivity-weighted
k-means); both write the real format, so the kernel and its reference read them as they
will read quantized checkpoints.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import BIT_WIDTHS, LUT_DTYPE, APLBlock, pack_planes


def nested_luts(lut8: torch.Tensor) -> dict[int, torch.Tensor]:
    """LUT_b for every b from an fp32 LUT_8 [rows, 256]: each b-bit centroid is the mean of
    its 2^(8-b) children, so codes nest (a b-bit code is the top b bits of the 8-bit one)."""
    rows = lut8.shape[0]
    return {b: lut8.view(rows, 1 << b, 1 << (8 - b)).mean(-1).to(LUT_DTYPE) for b in BIT_WIDTHS}


def random_block(rows: int, cols: int, generator: torch.Generator, device="cpu") -> APLBlock:
    """Uniformly random codes (every plane a random byte array) and sorted random LUTs
    scaled like a 1/sqrt(cols) initialisation."""
    planes = torch.randint(0, 256, (8, rows, cols // 8), dtype=torch.uint8, generator=generator)
    lut8 = torch.randn(rows, 256, generator=generator).sort(dim=1).values * cols ** -0.5
    return APLBlock(rows, cols, planes.to(device), {b: t.to(device) for b, t in nested_luts(lut8).items()})


def quantize_nested(w: torch.Tensor) -> APLBlock:
    """A plain nested quantizer: 8-bit codes on each row's uniform min..max grid, and LUT_b
    = the mean of the weights in each b-bit cluster (the cluster's grid centre if empty)."""
    w = w.float()
    rows, cols = w.shape
    lo, hi = w.min(dim=1, keepdim=True).values, w.max(dim=1, keepdim=True).values
    step = (hi - lo).clamp_min(1e-8) / 255
    codes = ((w - lo) / step).round().clamp(0, 255).to(torch.uint8)
    luts = {}
    for b in BIT_WIDTHS:
        idx = codes.long() >> (8 - b)
        sums = torch.zeros(rows, 1 << b).scatter_add_(1, idx, w)
        counts = torch.zeros(rows, 1 << b).scatter_add_(1, idx, torch.ones_like(w))
        centres = lo + step * ((torch.arange(1 << b) + 0.5) * (1 << (8 - b)) - 0.5)
        luts[b] = torch.where(counts > 0, sums / counts.clamp_min(1), centres).to(LUT_DTYPE)
    return APLBlock(rows, cols, pack_planes(codes), luts)


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[list[APLBlock], list[APLBlock]]:
    """DenseExperts tensors (gate_up [E, 2I, H], down [E, H, I]) -> APL blocks per expert."""
    return ([quantize_nested(w.detach().cpu()) for w in gate_up],
            [quantize_nested(w.detach().cpu()) for w in down])
