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
from pagedweight.format.apl_format import BIT_WIDTHS, LUT_WIDTHS, MAX_BITS, MIN_BITS, expand_lut, lut_entries, pack_planes, unpack_codes
from pagedweight.format.paged_model import LayerPlanes
from pagedweight.offline.apl_quantizer import (QuantizerConfig, dequantize_rows, quantize_rows, row_importance,
                                               seed_centroids)
from pagedweight.offline.error_feedback import feedback_codes, feedback_factors

DEFAULT_TILE_ELEMENTS = 1 << 24  # weights per k-means tile (~1.5 GB of temporaries)
DEFAULT_FEEDBACK_ELEMENTS = 1 << 28  # weights per error-feedback call (~2.3 GB: rows, their copy, codes)


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
                   feedback: torch.Tensor | None = None,
                   seed: tuple[torch.Tensor, torch.Tensor] | None = None) -> LayerResult:
    """w [E, R, C] (one module of every expert of a layer), h [E, C] -> planes, LUTs, errors.

    g [E, R] (output Fisher per row) weights rows in `col_errors_gn`; it cannot change a
    row's own k-means (a constant factor per row), only how rows add up.
    h_full [E, C, C]: the full smoothed input Hessians, which `config.error_feedback` and
    `config.lut_refit_bits` need. feedback: their factors (feedback_for) when the caller
    has them already (quantize_experts: one expert's row ranges share them); else made here.
    seed: the seed width's (centroids [E*R, 2^MIN_BITS], codes [E*R, C]) when the caller
    ran the k-means seed and the feedback already (quantize_experts); feedback is then unused.
    """
    E, R, C = w.shape
    _check_finite({"weights": w, "input Hessian": h, "output Fisher": g, "full input Hessian": h_full})
    rows = w.to(device, torch.float32).reshape(E * R, C)
    importance = h.to(device, torch.float32)[:, None, :].expand(E, R, C).reshape(E * R, C)
    if config.needs_full_hessians and h_full is None:
        raise UserError("error feedback and the LUT refit need the full input Hessians; "
                        "this quantiser path does not record them")
    h_full = h_full.to(device, torch.float32) if config.needs_full_hessians else None
    if feedback is None and seed is None:
        feedback = feedback_for(config, h_full)
    q = quantize_rows(rows, importance, config, feedback, h_full if config.lut_refit_bits else None, seed)
    planes = pack_planes(q.codes).view(8, E, R, C // 8).permute(1, 0, 2, 3).contiguous()
    # bits -> [E, C]: per expert, sum over its rows of the squared error per column
    sq = {b: ((rows - dequantize_rows(q, b)) ** 2).view(E, R, C) for b in BIT_WIDTHS}
    errors = {b: e.sum(1).cpu() for b, e in sq.items()}
    errors_gn = None
    if g is not None:
        g = g.to(device, torch.float32)[:, :, None]
        errors_gn = {b: (e * g).sum(1).cpu() for b, e in sq.items()}
    luts = {b: lut.view(E, R, -1).cpu() for b, lut in q.luts.items()}
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


def tiles_within(experts: slice, rows: slice, R: int, C: int, tile_elements: int):
    """`tiles` of the part (experts, rows) of an [E, R, C] stack, in the stack's indices."""
    if rows.start == 0 and rows.stop == R:
        for es, rs in tiles(experts.stop - experts.start, R, C, tile_elements):
            yield slice(experts.start + es.start, experts.start + es.stop), rs
        return
    step = max(1, tile_elements // C)  # a row range of one expert
    for r in range(rows.start, rows.stop, step):
        yield experts, slice(r, min(r + step, rows.stop))


def quantize_experts(w: torch.Tensor, h: torch.Tensor, config: QuantizerConfig, device: str,
                     tile_elements: int = DEFAULT_TILE_ELEMENTS, h_full: torch.Tensor | None = None,
                     feedback_elements: int = DEFAULT_FEEDBACK_ELEMENTS) -> LayerResult:
    """`quantize_layer` without G, tile by tile; the same planes, LUTs and errors.

    With error feedback the seed codes are made first for a group of up to
    `feedback_elements` weights (many k-means tiles: the feedback's column loop has C
    sequential steps per call, so fewer, larger calls cost fewer launches; it needs 9 bytes
    a weight, not k-means' tens; and at most feedback_elements // C^2 experts, whose Hessians
    and factors it holds: one expert of Mixtral's down, C = 14,336), then the k-means tiles
    of that group are split and refitted.
    Rows are independent in the seed k-means and the feedback, so the grouping changes no bit.
    """
    E, R, C = w.shape
    planes = torch.empty(E, 8, R, C // 8, dtype=torch.uint8)
    luts = {b: torch.empty(E, R, lut_entries(b), dtype=torch.float16) for b in LUT_WIDTHS}
    errors = {b: torch.zeros(E, C) for b in BIT_WIDTHS}
    full = h_full is not None and config.needs_full_hessians
    fed = full and config.error_feedback
    experts, h_dev, factors = None, None, None  # the last group's experts, their Hessians on the device, factors
    group_elements = tile_elements
    if fed:  # a group's Hessians and factors ([C, C] float32 each, on the device) are bounded too
        group_elements = max(tile_elements, min(feedback_elements, max(1, feedback_elements // (C * C)) * R * C))
    for eg, rg in tiles(E, R, C, group_elements):
        if full and (eg.start, eg.stop) != experts:
            # row ranges of one expert share its Hessians and their factors (a float64
            # Cholesky of [C, C] each): moved and factored once per expert, not per range
            experts, h_dev = (eg.start, eg.stop), h_full[eg].to(device, torch.float32)
            factors = feedback_for(config, h_dev)
        group_rows, seeds = None, None
        if fed:
            group_rows, seeds = _feedback_seeds(w[eg, rg], h[eg], config, device, factors, tile_elements)
        for es, rs in tiles_within(eg, rg, R, C, tile_elements):
            local = slice(es.start - eg.start, es.stop - eg.start)  # within the group
            part_w, seed = w[es, rs], None
            if fed:  # the group's rows are on the device already; its seeds sliced alike
                lr = slice(rs.start - rg.start, rs.stop - rg.start)
                part_w = group_rows[local, lr]
                seed = tuple(t[local, lr].reshape(-1, t.shape[-1]) for t in seeds)
            part = quantize_layer(part_w, h[es], config, device, h_full=h_dev[local] if full else None,
                                  feedback=factors, seed=seed)
            planes[es, :, rs] = part.planes.planes
            for b in LUT_WIDTHS:
                luts[b][es, rs] = part.planes.luts[b]
            for b in BIT_WIDTHS:
                if rs.start == 0 and rs.stop == R:
                    errors[b][es] = part.col_errors[b]
                else:  # row ranges of one expert: its column errors add up
                    errors[b][es] += part.col_errors[b]
    return LayerResult(LayerPlanes(planes, luts), errors, None)


def _feedback_seeds(w: torch.Tensor, h: torch.Tensor, config: QuantizerConfig, device: str,
                    factors: torch.Tensor, tile_elements: int):
    """w [n, r, C] (a group), h [n, C], factors [n, C, C] -> (rows on the device as fp32,
    (centroids [n, r, 2^MIN_BITS], codes [n, r, C] uint8)): the seed k-means tile by tile,
    then the error feedback over the whole group in one call."""
    n, r, C = w.shape
    rows = w.to(device, torch.float32)
    _check_finite({"weights": rows, "input Hessian": h})
    imp_all = h.to(device, torch.float32)
    centroids = torch.empty(n, r, 1 << MIN_BITS, dtype=torch.float32, device=rows.device)
    for es, rs in tiles(n, r, C, tile_elements):
        part = rows[es, rs]
        k = es.stop - es.start
        imp = row_importance(part.reshape(-1, C), imp_all[es][:, None, :].expand(k, rs.stop - rs.start, C).reshape(-1, C),
                             config)
        centroids[es, rs] = seed_centroids(part.reshape(-1, C), imp, config).view(k, -1, 1 << MIN_BITS)
    return rows, (centroids, feedback_codes(rows, factors, centroids))


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
            lut = expand_lut(planes.lut(b)[es, rs].to(device).reshape(n * r, -1), b).float().view(n, r, -1)
            deq = torch.gather(lut, 2, codes >> (MAX_BITS - b))
            out[b][es] += (((rows - deq) ** 2) * weight).sum(1).cpu()
    return out
