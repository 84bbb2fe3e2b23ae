"""APL blocks for tests and benchmarks: random ones, a simple nested quantizer, and whole
kernel cases (a random layer at mixed widths, a skewed ragged routing).

Neither is the project's quantizer (services/pagedweight/offline does the sensitivity-weighted
k-means); both write the real format, so the kernel and its reference read them as they
will read quantized checkpoints.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import LUT_DTYPE, LUT_WIDTHS, APLBlock, check_shape, pack_planes, refinement_bits, with_extent
from pagedweight_kernels.layer import APLLayer, resident_block


def nested_luts(lut8: torch.Tensor) -> dict[int, torch.Tensor]:
    """The stored LUTs (3 and 4 bits) from an fp32 256-entry table [rows, 256]: each centroid is
    the mean of its 2^(8-b) children, so codes nest (a b-bit code is the top b bits of the 8-bit one)."""
    rows = lut8.shape[0]
    luts = {b: lut8.view(rows, 1 << b, 1 << (8 - b)).mean(-1).to(LUT_DTYPE) for b in LUT_WIDTHS}
    luts[4] = with_extent(luts[4], lut8)
    return luts


def random_block(rows: int, cols: int, generator: torch.Generator, device="cpu") -> APLBlock:
    """Uniformly random codes (every plane a random byte array) and sorted random LUTs
    scaled like a 1/sqrt(cols) initialisation, drawn where the generator lives (random_layer
    passes a CUDA one for GPU layers: the CPU generator takes tens of seconds for a
    Qwen1.5-MoE-size layer) and then moved to `device`."""
    check_shape(rows, cols)
    where = generator.device
    planes = torch.randint(0, 256, (8, rows, cols // 8), dtype=torch.uint8, generator=generator, device=where)
    lut8 = torch.randn(rows, 256, generator=generator, device=where).sort(dim=1).values * cols ** -0.5
    return APLBlock(rows, cols, planes.to(device), {b: t.to(device) for b, t in nested_luts(lut8).items()})


def quantize_nested(w: torch.Tensor) -> APLBlock:
    """A plain nested quantizer: 4-bit codes on each row's uniform min..max grid, the stored
    LUT_3 / LUT_4 = the mean of the weights in each cluster (the cluster's grid centre if empty),
    and the refinement bits the format's 5-8-bit values ask for (apl_format.refinement_bits)."""
    w = w.float()
    rows, cols = w.shape
    lo, hi = w.min(dim=1, keepdim=True).values, w.max(dim=1, keepdim=True).values
    step = (hi - lo).clamp_min(1e-8) / 255
    codes = ((w - lo) / step).round().clamp(0, 255).to(torch.uint8)
    luts = {}
    for b in LUT_WIDTHS:
        idx = codes.long() >> (8 - b)
        sums = torch.zeros(rows, 1 << b).scatter_add_(1, idx, w)
        counts = torch.zeros(rows, 1 << b).scatter_add_(1, idx, torch.ones_like(w))
        centres = lo + step * ((torch.arange(1 << b) + 0.5) * (1 << (8 - b)) - 0.5)
        luts[b] = torch.where(counts > 0, sums / counts.clamp_min(1), centres).to(LUT_DTYPE)
    luts[4] = with_extent(luts[4], w)
    codes4 = codes.long() >> 4
    codes = ((codes4 << 4) | refinement_bits(w, codes4, luts[4])).to(torch.uint8)
    return APLBlock(rows, cols, pack_planes(codes), luts)


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[list[APLBlock], list[APLBlock]]:
    """DenseExperts tensors (gate_up [E, 2I, H], down [E, H, I]) -> APL blocks per expert."""
    return ([quantize_nested(w.detach().cpu()) for w in gate_up],
            [quantize_nested(w.detach().cpu()) for w in down])


def mixed_bits(num_experts: int) -> dict[tuple[int, str], int]:
    """# (expert, module) -> bits, every width 3..8 present once there are >= 3 experts."""
    return {(e, m): 3 + (2 * e + i) % 6 for e in range(num_experts) for i, m in enumerate(("gate_up", "down"))}


def random_layer(num_experts, hidden, intermediate, seed=0, device="cpu", bits=None,
                 activation: str = "silu") -> APLLayer:
    gen = torch.Generator(device=device).manual_seed(seed)  # (on a GPU: other draws than the CPU's, as deterministic)
    bits = bits or mixed_bits(num_experts)
    gate_up = [resident_block(random_block(2 * intermediate, hidden, gen, device), bits[(e, "gate_up")], device)
               for e in range(num_experts)]
    down = [resident_block(random_block(hidden, intermediate, gen, device), bits[(e, "down")], device)
            for e in range(num_experts)]
    return APLLayer(gate_up, down, activation)


def ragged_routing(num_tokens, num_experts, top_k, seed=0, num_used=None, device="cpu"):
    """Top-k routing over only `num_used` experts (the rest get no tokens), skewed so one
    expert is hot; weights normalised like Mixtral's."""
    gen = torch.Generator().manual_seed(seed)
    num_used = num_used or num_experts
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 2.0  # a hot expert
    logits[:, num_used:] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)
