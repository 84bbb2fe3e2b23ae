"""The APL quantiser: nested codes, LUT consistency, and error against a uniform grid."""

import dataclasses

import pytest
import torch

from pagedweight.offline.apl_quantizer import (
    KMEANS_ONLY, dequantize_rows, quantize_rows, uniform_grid_rows,
)
from pagedweight.format.apl_format import (
    BASE_LUT_BITS, BIT_WIDTHS, LUT_WIDTHS, MAX_BITS, APLBlock, cell_bounds, expand_lut, pack_planes,
)


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
    config = dataclasses.replace(KMEANS_ONLY, importance_floor=0.0)  # the floor would change the weights
    q = quantize_rows(w, imp, config)
    # LUT_4 as the 4-bit table alone: without the cell fit (cell_fit.py), which moves it for 5..8 bits
    means_only = quantize_rows(w, imp, dataclasses.replace(config, cell_fit_iters=0))
    imp_full = imp.expand_as(w)
    # the stored LUTs (LUT_3, LUT_4's 16 centroids) hold the clusters' weighted means
    for b, quantized in ((3, q), (3, means_only), (4, means_only)):
        codes = quantized.codes.long() >> (MAX_BITS - b)
        for r in (0, 17, 47):
            for c in codes[r].unique().tolist():
                members = codes[r] == c
                mean = (w[r, members] * imp_full[r, members]).sum() / imp_full[r, members].sum()
                assert torch.allclose(quantized.luts[b][r, c].float(), mean, rtol=2e-3, atol=2e-5)
    # format 2: 5..8-bit values are LUT_4's cells cut in 2^(b-4) equal parts (expand_lut); a
    # weight's b-bit value is the centre of the part of its 4-bit cell it lies in (clamped to
    # the cell), so it is at most half a part away from the weight clamped into its cell
    codes4 = q.codes.long() >> (MAX_BITS - BASE_LUT_BITS)
    low, high = cell_bounds(q.luts[BASE_LUT_BITS])
    low, high = torch.gather(low, 1, codes4), torch.gather(high, 1, codes4)
    clamped = torch.minimum(torch.maximum(w, low), high)
    for b in BIT_WIDTHS:
        if b > BASE_LUT_BITS:
            half_part = (high - low) / (1 << (b - BASE_LUT_BITS)) / 2
            values = dequantize_rows(q, b)
            # fp16 rounding: of the value, and of the cell's offset and width it is one FMA of
            # (docs/apl_format.md), whose magnitudes reach |low| + 2 (high - low)
            fp16_step = (values.abs() + low.abs() + 2 * (high - low)) * 2.0 ** -10 + 2.0 ** -24
            assert ((values - clamped).abs() <= half_part * (1 + 1e-5) + fp16_step).all(), b
    for b in BIT_WIDTHS:
        codes = q.codes.long() >> (MAX_BITS - b)
        if b < MAX_BITS:  # a (b+1)-bit cluster lies inside exactly one b-bit cluster
            finer = q.codes.long() >> (MAX_BITS - 1 - b)
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
    # the stored LUTs' weighted errors fall and beat a uniform grid; both the plain and the
    # weighted error fall with every bit, 4 -> 5 included (LUT_4 is fitted for 5..8 bits too)
    errors = [weighted_error(w, dequantize_rows(q, b), imp) for b in LUT_WIDTHS]
    assert all(lo > hi for lo, hi in zip(errors, errors[1:])), errors
    for b, err in zip(LUT_WIDTHS, errors):
        assert err < 0.8 * weighted_error(w, uniform_grid_rows(w, b), imp), b
    plain = [float(((w - dequantize_rows(q, b)) ** 2).sum()) for b in BIT_WIDTHS]
    assert all(lo > hi for lo, hi in zip(plain, plain[1:])), plain
    weighted = [weighted_error(w, dequantize_rows(q, b), imp) for b in BIT_WIDTHS]
    assert all(lo > hi for lo, hi in zip(weighted, weighted[1:])), weighted


def test_weighted_error_falls_from_4_to_5_bits_and_beats_a_uniform_grid_at_6():
    w, imp = heavy_tailed_rows()
    q = quantize_rows(w, imp)
    errors = {b: weighted_error(w, dequantize_rows(q, b), imp) for b in BIT_WIDTHS}
    assert errors[5] < errors[4], errors
    assert errors[6] < 0.8 * weighted_error(w, uniform_grid_rows(w, 6), imp)


@pytest.mark.xfail(strict=True, reason="format 2: every 5..8-bit value is an equal part of a LUT_4 cell, and the "
                   "cells that hold the outlier columns are wide; with LUT_4 fitted for widths 4..8 at once "
                   "(cell_fit.py) the weighted 5-, 7- and 8-bit errors on heavy-tailed rows are 0.89, 0.88 and "
                   "1.60 times a uniform grid's (0.024 vs 0.027, 0.0014 vs 0.0016, 6.3e-4 vs 3.9e-4; 3.18, 2.13 "
                   "and 1.99 times with LUT_4 the 4-bit table alone)")
def test_weighted_error_beats_a_uniform_grid_at_5_7_and_8_bits():
    w, imp = heavy_tailed_rows()
    q = quantize_rows(w, imp)
    for b in (5, 7, 8):
        assert weighted_error(w, dequantize_rows(q, b), imp) < 0.8 * weighted_error(w, uniform_grid_rows(w, b), imp), b


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
    for b in LUT_WIDTHS:
        assert torch.isfinite(q.luts[b].float()).all()
    for b in BIT_WIDTHS:
        assert torch.isfinite(expand_lut(q.luts[min(b, BASE_LUT_BITS)], b).float()).all()
    # exact where the values are stored centroids (3, 4 bits); 5..8 bits: the test below
    for b in LUT_WIDTHS:
        assert torch.allclose(dequantize_rows(q, b), w, atol=1e-3)


@pytest.mark.parametrize("values", [[0.25, -0.25], [0.0, 1.0, 2.0]])
def test_rows_with_few_distinct_values_are_exact_above_4_bits(values):
    # an unused 4-bit child must not leave a value on its cell's edge, where no sub-interval
    # centre is: the cell fit collapses the value's cell onto it (its neighbours' centroids equal)
    w = torch.tensor(values).repeat(4, 64 // len(values) + 1)[:, :64].contiguous()
    q = quantize_rows(w, torch.ones(64))
    for b in BIT_WIDTHS:
        assert torch.allclose(dequantize_rows(q, b), w, atol=1e-3), b
