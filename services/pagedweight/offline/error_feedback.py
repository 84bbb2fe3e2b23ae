"""GPTQ-style error feedback for the nested quantiser's 3-bit seed codes.

The k-means seed (apl_quantizer.py) weighs each column by the diagonal of the input
Hessian; how the columns' errors interact it cannot see. GPTQ (Frantar et al. 2022)
chooses a row's codes column by column and pushes each column's rounding error onto the
columns not yet quantised through the Cholesky factor U of the dampened inverse Hessian
(H + d * mean(diag H) * I)^-1 = U^T U, which lowers the block's output error
trace((W - Q) H (W - Q)^T). Here the LUT stays the seed's: only which entry each weight
takes changes, so the upscaling splits that follow divide these clusters as they divide
the k-means ones and the codes stay nested. The price of nesting: the feedback's clusters
overlap in value, so the splits above the seed width fit them worse than k-means'
clusters; a stronger dampening gives up some of the seed width's gain for less of that
loss (docs/quantize.md: with the LUT refit beside it, d = 3.0 x mean diagonal, the default,
was the setting that lowered the planner's mean KL at every budget; feedback alone measured
best at d = 1.0, and 0.1 for one width alone).

The full Hessian of an expert is smoothed like its diagonal (calibrate.smoothed_hessians):
the off-diagonal sums are divided by (tokens + prior_tokens) and the diagonal is the
smoothed diagonal, so an expert calibration rarely routes to leans on the layer's
diagonal prior, which feeds no error forward.
"""

from __future__ import annotations

import torch

from pagedweight.common.errors import UserError


def smoothed_full_hessians(gram: torch.Tensor, counts: torch.Tensor, h_diag: torch.Tensor,
                           prior_tokens: float) -> torch.Tensor:
    """gram [E, C, C] (sum of x x^T over routed tokens), counts [E], h_diag [E, C] (the
    smoothed diagonal) -> [E, C, C] float32 whose diagonal is h_diag."""
    full = gram.float() / (counts.float() + prior_tokens)[:, None, None]
    full.diagonal(dim1=1, dim2=2).copy_(h_diag.float())
    return full


_FACTOR_CHUNK_ELEMENTS = 1 << 25  # Hessian elements factored at once (256 MB per float64 temporary)


def feedback_factors(h: torch.Tensor, damp: float) -> torch.Tensor:
    """h [E, C, C] -> U [E, C, C] float32, upper triangular with U^T U = (h + damp *
    mean(diag h) * I)^-1 per expert (GPTQ's Cholesky form, computed in float64, a few
    experts at a time: quantize_experts hands it tens of experts' Hessians at once)."""
    if damp < 0:  # 0 is GPTQ undampened: fine while H is positive definite (checked below)
        raise UserError(f"error feedback needs a dampening >= 0, got {damp}")
    E, C = h.shape[0], h.shape[-1]
    step = max(1, _FACTOR_CHUNK_ELEMENTS // (C * C))
    out = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    eye = torch.eye(C, dtype=torch.float64, device=h.device)
    for start in range(0, E, step):
        part = h[start:start + step].double()
        mean_diag = part.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)
        chol, info = torch.linalg.cholesky_ex(part + damp * mean_diag[:, None, None] * eye)
        if bool((info != 0).any()):
            raise UserError(f"error feedback: the dampened input Hessian of expert(s) "
                            f"{((info != 0).nonzero().flatten() + start).tolist()} is not positive definite")
        out[start:start + step] = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    return out


def feedback_codes(w: torch.Tensor, u: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """w [E, R, C], u [E, C, C] (feedback_factors), lut [E, R, K] sorted -> codes [E, R, C]
    (uint8): each column's nearest LUT entry after the errors of the columns before it
    were fed forward.

    The loop has C sequential steps whatever E and R are, so its cost at real shapes is the
    launches of each step (layer_quantize.quantize_experts therefore hands it many experts
    at once) plus one pass over the columns not yet quantised. Every step is elementwise in
    the rows (no matrix product whose reduction order could depend on how many rows share
    the call): a row's codes are the same bits however the rows are grouped.
    """
    midpoints = ((lut[..., 1:] + lut[..., :-1]) / 2).contiguous()
    w = w.float().clone()
    # U's rows divided by their diagonal: err / U[c, c] * U[c, c+1:] becomes one fused
    # multiply-add over the remaining columns, with no [E, R, C] temporary
    scaled = (u.float() / u.diagonal(dim1=1, dim2=2)[:, :, None]).contiguous()
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for c in range(w.shape[2]):
        col = w[:, :, c:c + 1].contiguous()  # [E, R, 1]
        code = torch.searchsorted(midpoints, col)
        codes[:, :, c:c + 1] = code
        w[:, :, c + 1:].addcmul_(col - torch.gather(lut, 2, code), scaled[:, c:c + 1, c + 1:], value=-1.0)
    return codes


def block_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """trace((w - q) h (w - q)^T): the error a block's output sees, w and q [R, C], h [C, C]."""
    d = (w - q).double()
    return float(((d @ h.double()) * d).sum())
