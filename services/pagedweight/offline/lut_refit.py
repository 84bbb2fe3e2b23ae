"""Per-row LUT refit under the full input Hessian, with a ridge toward the bucket means.

The nested quantiser (apl_quantizer.py) sets every LUT entry to the h-weighted mean of its
bucket (the weights whose code selects it), which is optimal only when the columns' errors
do not interact (H diagonal). With the codes fixed, the LUT minimising the block's output
error (w - lut[codes]) H (w - lut[codes])^T solves (S H S^T) lut = S H w, S the one-hot
[K, C] of the row's codes. Solved alone that overfits: an entry few weights use comes from
a nearly singular S H S^T and extrapolates (bench/quantize_gptq_probe.py: the held-out
block error rose 1.3-3x at 4 bits on tiny-qwen-moe). The ridge pulls each entry toward its
bucket mean with the bucket's own diagonal mass m_k = sum_{c in k} H[c, c]:

    (S H S^T + ridge * diag(m)) lut = S H w + ridge * m * bucket_mean

so ridge -> infinity gives the bucket means back, and for a diagonal H the two agree at
any ridge (the refit only moves entries because of the off-diagonal of H). Codes are not
touched, so every width still reads the same planes (the format's nesting).

Cost: S H S^T for every row at the widest refitted width, by a one-hot matmul in float64
(2 x rows x K x C^2 flops), in chunks of rows; the narrower widths' systems are sums of its
2x2 blocks (a b-bit bucket is the union of two (b+1)-bit buckets). float64 so that the
chunking (which the tiles decide) cannot move a LUT entry by an fp16 step: the streaming
and whole-model quantisers must write the same LUTs.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import MAX_BITS

_CHUNK_ELEMENTS = 1 << 24  # rows x K x C of the one-hot product held at once


def refit_luts(w: torch.Tensor, codes: torch.Tensor, luts: dict[int, torch.Tensor], hessians: torch.Tensor,
               ridge: float, widths: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """w [R, C] fp32, codes [R, C] 8-bit nested codes, luts bits -> [R, 2^bits] (the bucket
    means), hessians [G, C, C] for G equal groups of consecutive rows -> the same dict
    with the `widths` refitted (float32; others unchanged). Unused entries keep their value."""
    R, C = w.shape
    G = hessians.shape[0]
    rows_per_group = R // G
    chunk = max(1, _CHUNK_ELEMENTS // ((1 << max(widths)) * C))
    fitted = {b: torch.empty(luts[b].shape, dtype=torch.float32, device=w.device) for b in widths}
    for g in range(G):
        h = hessians[g]
        for start in range(g * rows_per_group, (g + 1) * rows_per_group, chunk):
            rows = slice(start, min(start + chunk, (g + 1) * rows_per_group))
            for b, system in bucket_systems(w[rows], codes[rows], h, widths).items():
                fitted[b][rows] = solve_ridge(*system, luts[b][rows].double(), ridge).float()
    return {**luts, **fitted}


def bucket_systems(w: torch.Tensor, codes: torch.Tensor, h: torch.Tensor,
                   widths: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rows w [r, C] sharing one Hessian h [C, C] -> bits -> (S H S^T [r, K, K], S H w [r, K],
    bucket mass [r, K]) in float64, for every width in `widths`."""
    top = max(widths)
    K = 1 << top
    h = h.double()
    one_hot = torch.nn.functional.one_hot(codes.long() >> (MAX_BITS - top), K).double()  # [r, C, K]
    hs = h @ one_hot
    a = one_hot.transpose(1, 2) @ hs
    rhs = (hs * w.double()[:, :, None]).sum(1)  # S H w, H symmetric
    mass = h.diagonal() @ one_hot
    out = {}
    for b in range(top, min(widths) - 1, -1):
        if b in widths:
            out[b] = (a, rhs, mass)
        # the (b-1)-bit bucket k is the union of b-bit buckets 2k and 2k+1
        a = a.unflatten(1, (-1, 2)).sum(2).unflatten(2, (-1, 2)).sum(3)
        rhs, mass = rhs.unflatten(1, (-1, 2)).sum(2), mass.unflatten(1, (-1, 2)).sum(2)
    return out


def solve_ridge(a: torch.Tensor, rhs: torch.Tensor, mass: torch.Tensor, means: torch.Tensor,
                ridge: float) -> torch.Tensor:
    """(a + ridge diag(mass)) lut = rhs + ridge mass means per row [r, K]; an empty bucket
    (mass 0, its row of a zero) keeps its mean: a tiny multiple of the row's mean mass
    stands in for its ridge so the system stays solvable."""
    floor = 1e-6 * mass.mean(1, keepdim=True).clamp_min(1e-30)
    pull = ridge * mass + floor
    lut = torch.linalg.solve(a + torch.diag_embed(pull), (rhs + pull * means)[..., None])[..., 0]
    return torch.where(mass > 0, lut, means)
