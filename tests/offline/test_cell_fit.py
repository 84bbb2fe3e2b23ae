"""The LUT_4 cell fit: its value model is the format's, it lowers the error summed over the widths
LUT_4 serves, and with the refit's anchor it keeps the 4-bit codes."""

import dataclasses

import pytest
import torch

from pagedweight.format.apl_format import BASE_LUT_BITS, MAX_BITS, expand_lut, refinement_bits, with_extent
from pagedweight.common.errors import UserError
from pagedweight.offline.apl_quantizer import (
    KMEANS_ONLY, QuantizerConfig, dequantize_rows, quantize_rows, row_importance,
)
from pagedweight.offline.cell_fit import _cell_vectors, _fractions, fit_cells

from tests.offline.test_apl_quantizer import heavy_tailed_rows

WIDE = range(BASE_LUT_BITS + 1, MAX_BITS + 1)


def summed_error(w, q, importance):
    """Per row: the importance-weighted squared error at 4 bits plus at each of 5..8 bits, weighted as
    the cell fit weighs them (its objective with LUT_4 the 4-bit table, up to a constant)."""
    weights = (1.0, *QuantizerConfig().cell_fit_weights)
    return sum(lam * ((w - dequantize_rows(q, b)) ** 2 * importance).sum(1)
               for lam, b in zip(weights, range(BASE_LUT_BITS, MAX_BITS + 1)))


def test_value_model_is_expand_lut():
    # (u_p + f d_p) . theta must be the format's b-bit value of code p << s | j, else the fit
    # optimises values no kernel reads
    g = torch.Generator().manual_seed(1)
    centroids = torch.sort(torch.randn(5, 16, generator=g), dim=1).values
    lut = with_extent(centroids, torch.randn(5, 64, generator=g) * 3)
    u, d = _cell_vectors("cpu")
    frac = _fractions("cpu")
    theta = lut.double()
    for i, b in enumerate(WIDE):
        steps = 1 << (b - BASE_LUT_BITS)
        model = (theta @ u.T)[:, :, None] + (theta @ d.T)[:, :, None] * frac[i, ::16 // steps]
        table = expand_lut(lut, b).double().view(5, 16, steps)  # fp16: one rounding of the exact value
        assert torch.allclose(model, table, rtol=0, atol=2.0 ** -10 * float(theta.abs().max()) * 4), b


def test_fit_lowers_every_rows_summed_error():
    w, imp = heavy_tailed_rows()
    start = quantize_rows(w, imp, dataclasses.replace(KMEANS_ONLY, cell_fit_iters=0))
    fitted = quantize_rows(w, imp)
    weight = row_importance(w, imp, KMEANS_ONLY)
    before, after = summed_error(w, start, weight), summed_error(w, fitted, weight)
    assert (after <= before * (1 + 1e-3)).all()  # a row keeps its start unless the fit lowers it
    assert after.sum() < 0.6 * before.sum()
    # the 3-bit codes, hence the nesting, stay
    assert torch.equal(fitted.codes >> (MAX_BITS - 3), start.codes >> (MAX_BITS - 3))
    assert torch.equal(fitted.luts[3], start.luts[3])


def test_anchored_fit_keeps_the_4_bit_codes_and_prices_the_4_bit_error_by_its_curvature():
    w, imp = heavy_tailed_rows(rows=8)
    q = quantize_rows(w, imp, dataclasses.replace(KMEANS_ONLY, cell_fit_iters=0))
    codes4 = q.codes.long() >> (MAX_BITS - BASE_LUT_BITS)
    lut4 = q.luts[BASE_LUT_BITS]
    centroids = lut4[:, :16].float()
    # an anchor a thousand times stiffer than the wider widths' weights keeps the centroids
    stiff = torch.eye(16).expand(8, 16, 16) * 1e3 * float(imp.sum())
    lut, codes = fit_cells(w, imp.expand_as(w), codes4, lut4, 4, (1.0,) * 4, (stiff, centroids))
    assert torch.equal(codes, codes4)
    assert torch.allclose(lut[:, :16].float(), centroids, atol=2e-3 * float(w.abs().max()))
    # a soft one lets them move, and the wider widths' error falls
    soft = stiff * 1e-6
    lut, _ = fit_cells(w, imp.expand_as(w), codes4, lut4, 4, (1.0,) * 4, (soft, centroids))
    wide = {}
    for name, table in (("start", lut4), ("fitted", lut)):
        sub = refinement_bits(w, codes4, table)
        codes8 = (codes4 << (MAX_BITS - BASE_LUT_BITS)) | sub
        wide[name] = sum(float((((w - torch.gather(expand_lut(table, b).float(), 1, codes8 >> (MAX_BITS - b))) ** 2)
                                * imp).sum()) for b in WIDE)
    assert wide["fitted"] < 0.8 * wide["start"]


def test_config_refuses_width_weights_that_are_not_one_per_wider_width():
    for weights in ((1.0, 1.0, 1.0), (1.0, 1.0, -1.0, 1.0)):
        with pytest.raises(UserError, match="cell fit weights"):
            QuantizerConfig(cell_fit_weights=weights)
