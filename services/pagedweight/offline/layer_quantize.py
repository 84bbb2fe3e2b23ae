"""Quantise one (layer, module): every expert's rows into APL planes, LUTs and error tables.

`quantize_layer` does a whole [E, R, C] stack at once; `quantize_experts` runs it over
tiles of whole experts (or row ranges of one expert when a single expert is bigger than a
tile), so the k-means temporaries (tens of bytes per weight) stay within a bounded slice
of device memory whatever the model size. Rows are quantised independently (per-row
k-means; the seed loop's early stop only ends once every row of the tile is a fixed
point, which further iterations would keep), so tiling changes no code, no LUT entry.

`gn_col_errors` gives the Gauss-Newton error table from planes already written and the
output Fisher G, which the streaming quantiser only knows after its backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BIT_WIDTHS, MAX_BITS, pack_planes, unpack_codes
from pagedweight.format.paged_model import LayerPlanes
from pagedweight.offline.apl_quantizer import QuantizerConfig, dequantize_rows, quantize_rows
from pagedweight.offline.error_feedback import feedback_factors

DEFAULT_TILE_ELEMENTS = 1 << 24  # weights per k-means tile (~1.5 GB of temporaries)


@dataclass
class LayerResult:
    planes: LayerPlanes
    col_errors: dict[int, torch.Tensor]  # bits -> [E, C]
    col_errors_gn: dict[int, torch.Tensor] | None  # bits -> [E, C], rows weighted by G


def _check_finite(named: dict[str, torch.Tensor | None]) -> None:
    # k-means over a NaN or infinite weight or importance gives NaN centroids for the whole
    # row: stop here rather than write an artifact every later run would trust
    for name, t in named.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            raise UserError(f"quantiser input {name} [{tuple(t.shape)}] holds NaN or infinite values")


def quantize_layer(w: torch.Tensor, h: torch.Tensor, config: QuantizerConfig, device: str,
                   g: torch.Tensor | None = None, h_full: torch.Tensor | None = None,
                   feedback: torch.Tensor | None = None) -> LayerResult:
    """w [E, R, C] (one module of every expert of a layer), h [E, C] -> planes, LUTs, errors.

    g [E, R] (output Fisher per row) weights rows in `col_errors_gn`; it cannot change a
    row's own k-means (a constant factor per row), only how rows add up.
    h_full [E, C, C]: the full smoothed input Hessians, which `config.error_feedback` and
    `config.lut_refit_bits` need. feedback: their factors (feedback_for) when the caller
    has them already (quantize_experts: one expert's row ranges share them); else made here.
    """
    E, R, C = w.shape
    _check_finite({"weights": w, "input Hessian": h, "output Fisher": g, "full input Hessian": h_full})
    rows = w.to(device, torch.float32).reshape(E * R, C)
    importance = h.to(device, torch.float32)[:, None, :].expand(E, R, C).reshape(E * R, C)
    if config.needs_full_hessians and h_full is None:
        raise UserError("error feedback and the LUT refit need the full input Hessians; "
                        "this quantiser path does not record them")
    h_full = h_full.to(device, torch.float32) if config.needs_full_hessians else None
    if feedback is None:
        feedback = feedback_for(config, h_full)
    q = quantize_rows(rows, importance, config, feedback, h_full if config.lut_refit_bits else None)
    planes = pack_planes(q.codes).view(8, E, R, C // 8).permute(1, 0, 2, 3).contiguous()
    # bits -> [E, C]: per expert, sum over its rows of the squared error per column
    sq = {b: ((rows - dequantize_rows(q, b)) ** 2).view(E, R, C) for b in BIT_WIDTHS}
    errors = {b: e.sum(1).cpu() for b, e in sq.items()}
    errors_gn = None
    if g is not None:
        g = g.to(device, torch.float32)[:, :, None]
        errors_gn = {b: (e * g).sum(1).cpu() for b, e in sq.items()}
    luts = {b: lut.view(E, R, 1 << b).cpu() for b, lut in q.luts.items()}
    return LayerResult(LayerPlanes(planes.cpu(), luts), errors, errors_gn)


def feedback_for(config: QuantizerConfig, h_full: torch.Tensor | None) -> torch.Tensor | None:
    """The error-feedback factors `quantize_rows` takes, or None when the option is off."""
    return feedback_factors(h_full, config.feedback_damp) if config.error_feedback else None


def tiles(num_experts: int, rows: int, cols: int, tile_elements: int):
    """(expert slice, row slice) tiles: whole experts while they fit, else row ranges."""
    per_expert = rows * cols
    if per_expert <= tile_elements:
        step = max(1, tile_elements // per_expert)
        for e in range(0, num_experts, step):
            yield slice(e, min(e + step, num_experts)), slice(0, rows)
        return
    row_step = max(1, tile_elements // cols)
    for e in range(num_experts):
        for r in range(0, rows, row_step):
            yield slice(e, e + 1), slice(r, min(r + row_step, rows))


def quantize_experts(w: torch.Tensor, h: torch.Tensor, config: QuantizerConfig, device: str,
                     tile_elements: int = DEFAULT_TILE_ELEMENTS, h_full: torch.Tensor | None = None) -> LayerResult:
    """`quantize_layer` without G, tile by tile; the same planes, LUTs and errors."""
    E, R, C = w.shape
    planes = torch.empty(E, 8, R, C // 8, dtype=torch.uint8)
    luts = {b: torch.empty(E, R, 1 << b, dtype=torch.float16) for b in BIT_WIDTHS}
    errors = {b: torch.zeros(E, C) for b in BIT_WIDTHS}
    experts, h_dev, feedback = None, None, None  # the last tile's experts, their Hessians on the device, factors
    for es, rs in tiles(E, R, C, tile_elements):
        if h_full is not None and config.needs_full_hessians and (es.start, es.stop) != experts:
            # row ranges of one expert share its Hessians and their factors (a float64
            # Cholesky of [C, C] each): moved and factored once per expert, not per range
            experts, h_dev = (es.start, es.stop), h_full[es].to(device, torch.float32)
            feedback = feedback_for(config, h_dev)
        part = quantize_layer(w[es, rs], h[es], config, device, h_full=h_dev, feedback=feedback)
        planes[es, :, rs] = part.planes.planes
        for b in BIT_WIDTHS:
            luts[b][es, rs] = part.planes.luts[b]
            if rs.start == 0 and rs.stop == R:
                errors[b][es] = part.col_errors[b]
            else:  # row ranges of one expert: its column errors add up
                errors[b][es] += part.col_errors[b]
    return LayerResult(LayerPlanes(planes, luts), errors, None)


def gn_col_errors(w: torch.Tensor, planes: LayerPlanes, g: torch.Tensor, device: str,
                  tile_elements: int = DEFAULT_TILE_ELEMENTS) -> dict[int, torch.Tensor]:
    """bits -> [E, C]: sum over rows of G[e, r] (w - Q_b(w))^2, from the stored planes
    (the values `quantize_layer` weights by G, tile by tile)."""
    E, R, C = w.shape
    _check_finite({"output Fisher": g})
    out = {b: torch.zeros(E, C) for b in BIT_WIDTHS}
    for es, rs in tiles(E, R, C, tile_elements):
        n = es.stop - es.start
        rows = w[es, rs].to(device, torch.float32)  # [n, r, C]
        r = rows.shape[1]
        # [n, 8, r, C/8] -> [8, n*r, C/8]: every row's planes, as unpack_codes reads one block
        packed = planes.planes[es, :, rs].to(device).permute(1, 0, 2, 3).reshape(8, n * r, C // 8)
        codes = unpack_codes(packed, MAX_BITS).view(n, r, C)
        weight = g[es, rs].to(device, torch.float32)[:, :, None]
        for b in BIT_WIDTHS:
            lut = planes.luts[b][es, rs].to(device).float()  # [n, r, 2^b]
            deq = torch.gather(lut, 2, codes >> (MAX_BITS - b))
            out[b][es] += (((rows - deq) ** 2) * weight).sum(1).cpu()
    return out
