"""The GPTQ probe's two operations against what they must reduce to: with a diagonal
Hessian no error is fed forward (GPTQ's codes are each weight's nearest LUT entry) and the
least-squares LUT is the Hessian-weighted mean of each code's weights; with a full Hessian
the refitted LUT is a minimum (no perturbation lowers the error) and feedback lowers the
error it optimises against the nearest-entry codes."""

from __future__ import annotations

import torch

from bench.quantize_gptq_probe import block_error, gptq_codes, refit_lut
from pagedweight.offline.apl_quantizer import _assign


def problem(seed: int = 0, R: int = 6, C: int = 24, K: int = 8):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(R, C, generator=gen)
    lut, _ = torch.sort(torch.randn(R, K, generator=gen), dim=1)
    x = torch.randn(200, C, generator=gen) @ torch.randn(C, C, generator=gen)  # correlated inputs
    return w, lut, x.T @ x


def test_diagonal_hessian_reduces_to_nearest_codes_and_weighted_means():
    w, lut, h = problem()
    diag = torch.diag(h.diagonal())
    codes = gptq_codes(w, diag, lut, damp=0.0)
    assert torch.equal(codes, _assign(w, lut))
    refit = refit_lut(w, diag, codes, lut.shape[1], lut)
    for r in range(w.shape[0]):
        for k in codes[r].unique():
            members = codes[r] == k
            weights = h.diagonal()[members]
            mean = (w[r, members] * weights).sum() / weights.sum()
            torch.testing.assert_close(refit[r, k], mean, rtol=1e-4, atol=1e-5)


def test_full_hessian_feedback_and_refit_lower_the_error():
    w, lut, h = problem(1)
    nearest = _assign(w, lut)
    codes = gptq_codes(w, h, lut, damp=0.0)
    assert block_error(w, torch.gather(lut, 1, codes), h) < block_error(w, torch.gather(lut, 1, nearest), h)
    refit = refit_lut(w, h, codes, lut.shape[1], lut)
    best = block_error(w, torch.gather(refit, 1, codes), h)
    assert best < block_error(w, torch.gather(lut, 1, codes), h)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        moved = refit + 1e-2 * torch.randn(refit.shape, generator=gen)
        assert block_error(w, torch.gather(moved, 1, codes), h) > best
