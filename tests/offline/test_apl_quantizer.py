"""The APL quantiser: nested codes, LUT consistency, and error against a uniform grid."""

import dataclasses

import pytest
import torch

from pagedweight.offline.apl_quantizer import (
    KMEANS_ONLY, dequantize_rows, quantize_rows, uniform_grid_rows,
)
from pagedweight.format.apl_format import BIT_WIDTHS, APLBlock, pack_planes


def heavy_tailed_rows(rows=48, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, :4] *= 8  # outliers, as trained weights have
    importance = torch.rand(cols, generator=g) ** 4 + 1e-4
    return w, importance


def weighted_error(w, w_hat, importance):
    return float(((w - w_hat) ** 2 * importance).sum())


def test_b_bit_clusters_are_the_top_b_bits_and_luts_are_their_weighted_means():
    w, imp = heavy_tailed_rows()
    q = quantize_rows(w, imp, dataclasses.replace(KMEANS_ONLY, importance_floor=0.0))  # the floor would change the weights
    imp_full = imp.expand_as(w)
    for b in BIT_WIDTHS:
        codes = q.codes.long() >> (8 - b)
        for r in (0, 17, 47):
            for c in codes[r].unique().tolist():
                members = codes[r] == c
                mean = (w[r, members] * imp_full[r, members]).sum() / imp_full[r, members].sum()
                assert torch.allclose(q.luts[b][r, c].float(), mean, rtol=2e-3, atol=2e-5)
        if b < 8:  # a (b+1)-bit cluster lies inside exactly one b-bit cluster
            finer = q.codes.long() >> (7 - b)
            assert torch.equal(finer >> 1, codes)


def test_planes_rebuild_every_width_of_the_quantiser():
    w, imp = heavy_tailed_rows(rows=8, cols=64)
    q = quantize_rows(w, imp)
    block = APLBlock(8, 64, pack_planes(q.codes), q.luts)
    for b in BIT_WIDTHS:
        assert torch.equal(block.dequantize(b).float(), dequantize_rows(q, b))


def test_error_falls_with_every_bit_and_beats_a_uniform_grid():
    w, imp = heavy_tailed_rows()
    q = quantize_rows(w, imp)
    errors = [weighted_error(w, dequantize_rows(q, b), imp) for b in BIT_WIDTHS]
    assert all(lo > hi for lo, hi in zip(errors, errors[1:])), errors
    for b, err in zip(BIT_WIDTHS, errors):
        assert err < 0.8 * weighted_error(w, uniform_grid_rows(w, b), imp), b


def test_weighting_protects_important_columns():
    w, _ = heavy_tailed_rows()
    imp = torch.full((w.shape[1],), 1e-3)
    imp[100:110] = 1.0
    weighted = quantize_rows(w, imp, dataclasses.replace(KMEANS_ONLY, importance_floor=0.0))
    flat = quantize_rows(w, torch.ones_like(imp))
    cols = slice(100, 110)
    err_weighted = ((w - dequantize_rows(weighted, 3))[:, cols] ** 2).sum()
    err_flat = ((w - dequantize_rows(flat, 3))[:, cols] ** 2).sum()
    assert err_weighted < 0.5 * err_flat


@pytest.mark.parametrize("values", [[0.5], [0.25, -0.25], [0.0, 1.0, 2.0]])
def test_rows_with_few_distinct_values_are_exact_and_finite(values):
    w = torch.tensor(values).repeat(4, 64 // len(values) + 1)[:, :64].contiguous()
    q = quantize_rows(w, torch.ones(64))
    for b in BIT_WIDTHS:
        assert torch.isfinite(q.luts[b].float()).all()
        assert torch.allclose(dequantize_rows(q, b), w, atol=1e-3)
