"""The LUT refit (offline/lut_refit.py): each row's LUT against a plain per-row least-squares
reference built from explicit one-hot matrices, the bucket means back for a diagonal
Hessian and for a large ridge, a lower block error under H at ridge 0, codes (planes)
untouched, tiling and row chunks that change nothing, and the CLI flags (the streaming and
whole-model quantisers writing the same artifact with it: test_quantize_stream, the default)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedweight.format.apl_format import LUT_WIDTHS, MAX_BITS
from pagedweight.offline import lut_refit
from pagedweight.offline.apl_quantizer import KMEANS_ONLY, dequantize_rows, quantize_rows
from pagedweight.offline.error_feedback import block_error
from pagedweight.offline.layer_quantize import quantize_experts, quantize_layer
from pagedweight.offline.lut_refit import refit_luts
from tests.offline.test_error_feedback import correlated_block

WIDTHS = LUT_WIDTHS  # format 2 refits only the stored LUTs, LUT_3 and LUT_4 (5..8 bits derive from LUT_4)


def bucket_means(q):
    """The quantiser's stored LUTs as refit_luts takes them: each width's 2^b centroids
    (LUT_4 without its 17th entry, the extent, which the quantiser sets after the refit)."""
    return {b: q.luts[b][:, :1 << b].float() for b in LUT_WIDTHS}


def reference_refit(w, codes, means, h, ridge):
    """Per row, argmin_lut (w - S^T lut) H (w - S^T lut)^T + ridge sum_k m_k (lut_k - mean_k)^2
    with S the explicit one-hot [K, C], solved as a stacked least-squares problem in float64."""
    w, h, means = w.double(), h.double(), means.double()
    K = means.shape[1]
    L = torch.linalg.cholesky(h)  # H = L L^T, so the error is |L^T (w - S^T lut)|^2
    out = means.clone()
    for r in range(w.shape[0]):
        S = torch.nn.functional.one_hot(codes[r], K).double().T  # [K, C]
        mass = S @ h.diagonal()
        used = mass > 0
        A = torch.cat([L.T @ S[used].T, torch.diag((ridge * mass[used]).sqrt())])
        y = torch.cat([L.T @ w[r], (ridge * mass[used]).sqrt() * means[r, used]])
        out[r, used] = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    return out


# the k-means quantiser whose LUT_4 holds the 4-bit bucket means (no cell fit for the wider widths)
MEANS_ONLY = dataclasses.replace(KMEANS_ONLY, cell_fit_iters=0)


def plain_rows(w, h):
    return quantize_rows(w, h.diagonal(), MEANS_ONLY)


@pytest.mark.parametrize("ridge", [0.0, 0.3])
def test_refit_equals_per_row_least_squares(ridge):
    w, h = correlated_block(E=1, R=12, C=32)
    q = plain_rows(w[0], h[0])
    means = bucket_means(q)
    fitted = refit_luts(w[0], q.codes, means, h, ridge, WIDTHS)
    for b in WIDTHS:
        codes = q.codes.long() >> (MAX_BITS - b)
        ref = reference_refit(w[0], codes, means[b], h[0], ridge)
        torch.testing.assert_close(fitted[b].double(), ref, rtol=1e-4, atol=1e-5)
    # a width not asked for keeps its LUT (every stored width is refitted by default, so ask for one)
    only4 = refit_luts(w[0], q.codes, means, h, ridge, (4,))
    torch.testing.assert_close(only4[4], fitted[4], rtol=0, atol=0)
    assert torch.equal(only4[3], means[3])


def test_diagonal_hessian_or_a_large_ridge_gives_the_bucket_means():
    w, h = correlated_block(E=1, R=12, C=32)
    q = quantize_rows(w[0], h[0].diagonal(), dataclasses.replace(MEANS_ONLY, importance_floor=0.0))
    means = bucket_means(q)
    diagonal = torch.diag_embed(h.diagonal(dim1=1, dim2=2))
    for ridge in (0.0, 1.0):
        fitted = refit_luts(w[0], q.codes, means, diagonal, ridge, WIDTHS)
        for b in WIDTHS:  # the means were rounded to fp16: agree to its precision
            torch.testing.assert_close(fitted[b], means[b], rtol=2e-3, atol=2e-3)
    far = refit_luts(w[0], q.codes, means, h, 1e6, WIDTHS)
    for b in WIDTHS:
        torch.testing.assert_close(far[b], means[b], rtol=1e-4, atol=1e-4)


def test_refit_lowers_the_block_error_and_keeps_the_planes():
    w, h = correlated_block()
    diag = h.diagonal(dim1=1, dim2=2)
    config = dataclasses.replace(KMEANS_ONLY, seed_iters=6, split_iters=2)
    plain = quantize_layer(w, diag, config, "cpu")
    refit = quantize_layer(w, diag, dataclasses.replace(config, lut_refit_bits=WIDTHS, lut_ridge=0.0), "cpu",
                           h_full=h)
    # the 4-bit codes are untouched (still nested); planes 4..7, the refinement bits, are each
    # weight's part of its LUT_4 cell, so they follow the refitted LUT_4 (format 2)
    assert torch.equal(plain.planes.planes[:, :4], refit.planes.planes[:, :4])  # [E, 8, R, C/8]
    for e in range(w.shape[0]):
        q = quantize_rows(w[e], diag[e], config)
        for b in WIDTHS:
            err = {}
            for name, result in (("plain", plain), ("refit", refit)):
                q.luts[b] = result.planes.luts[b][e]
                err[name] = block_error(w[e], dequantize_rows(q, b), h[e])
            assert err["refit"] < 0.95 * err["plain"], (e, b, err)


@pytest.mark.parametrize("tile_elements", [48 * 32, 2 * 48 * 32, 16 * 32])  # experts, uneven, row ranges
def test_tiles_and_row_chunks_change_nothing(tile_elements, monkeypatch):
    w, h = correlated_block()
    config = dataclasses.replace(KMEANS_ONLY, seed_iters=6, split_iters=2, error_feedback=True, lut_refit_bits=WIDTHS)
    diag = h.diagonal(dim1=1, dim2=2)
    whole = quantize_layer(w, diag, config, "cpu", h_full=h)
    monkeypatch.setattr(lut_refit, "_CHUNK_ELEMENTS", 5 * 16 * 32)  # 5 rows per product at 4 bits
    monkeypatch.setattr(lut_refit, "_SOLVE_ELEMENTS", 7 * 16 * 16)  # solved 7 rows at a time: across experts
    tiled = quantize_experts(w, diag, config, "cpu", tile_elements, h_full=h)
    assert torch.equal(tiled.planes.planes, whole.planes.planes)
    for b in LUT_WIDTHS:
        torch.testing.assert_close(tiled.planes.luts[b], whole.planes.luts[b], rtol=0, atol=0)


@pytest.mark.slow
def test_cli_refit_is_recorded_and_a_bad_ridge_refused(tmp_path, calib_files, capsys):
    import json
    import subprocess

    from pagedweight.cli.main import main
    from tests.cli.test_cli import assert_one_line_error
    from tests.conftest import BUNDLED_MODEL

    args = ["quantize", "--model", str(BUNDLED_MODEL), "--calib", *map(str, calib_files), "--calib-tokens", "128",
            "--seq-len", "64", "--threads", "1", "--quiet", "--scale-tokens", "0"]
    assert main([*args, "--out", str(tmp_path / "r"), "--lut-refit-bits", "4", "3", "--lut-ridge", "0.5"]) == 0
    config = json.loads((tmp_path / "r" / "paged_model.json").read_text())["quantizer"]["config"]
    assert config["lut_refit_bits"] == [3, 4] and config["lut_ridge"] == 0.5
    capsys.readouterr()
    for bad, flag in ((["--lut-ridge", "-1"], "--lut-ridge"), (["--lut-refit-bits", "2"], "--lut-refit-bits")):
        code = main([*args, "--out", str(tmp_path / "bad"), *bad])
        out, err = capsys.readouterr()
        assert_one_line_error(subprocess.CompletedProcess([], code, out, err), flag)


def fp16_steps(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|a - ref| in units of the fp16 spacing just above |ref| (both fp16; subnormals'
    spacing 2^-24 near zero)."""
    mag = ref.abs()
    step = torch.nextafter(mag, torch.full_like(mag, torch.inf)).float() - mag.float()
    return (a.float() - ref.float()).abs() / step


def _products_against_float64(device: str):
    """The default quantiser's rows on correlated_block with each refit product: planes
    (codes) identical to float64's, LUT entries at most one fp16 step from it."""
    from pagedweight.offline.apl_quantizer import QuantizerConfig
    from pagedweight.offline.error_feedback import feedback_factors

    w, h = correlated_block(E=2, R=64, C=128)
    w, h = w.to(device), h.to(device)
    for e in range(2):
        fb = feedback_factors(h[e][None], QuantizerConfig().feedback_damp)
        out = {p: quantize_rows(w[e], h[e].diagonal(), QuantizerConfig(lut_refit_product=p), fb, h[e][None])
               for p in lut_refit.PRODUCTS}
        ref = out["float64"]
        for p, q in out.items():
            assert torch.equal(q.codes, ref.codes), p
            for b in QuantizerConfig().lut_refit_bits:
                steps = fp16_steps(q.luts[b], ref.luts[b])
                assert float(steps.max()) <= 1.0, (p, b, float(steps.max()))
                assert float((steps > 0).float().mean()) < 0.01, (p, b)


def test_float32_accurate_products_stay_within_one_fp16_step_of_float64():
    _products_against_float64("cpu")


@pytest.mark.gpu
def test_bf16x3_on_the_tensor_cores_stays_within_one_fp16_step_of_float64():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _products_against_float64("cuda")


def test_bf16x3_parts_sum_to_the_hessian():
    _, h = correlated_block(E=1, C=64)
    parts = lut_refit.hessian_parts(h[0].double(), "bf16x3")
    total = sum(p.double() for p in parts)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    rel = float((total - h[0].double()).abs().max() / h[0].abs().max())
    assert rel < 2 ** -22, rel
    assert float((parts[0].double() - h[0].double()).abs().max() / h[0].abs().max()) > 2 ** -12  # bf16 alone is not


def test_an_unknown_refit_product_is_refused():
    from pagedweight.common.errors import UserError
    from pagedweight.offline.apl_quantizer import QuantizerConfig

    with pytest.raises(UserError, match="refit product"):
        QuantizerConfig(lut_refit_product="float16")
