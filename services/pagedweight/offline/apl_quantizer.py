"""Any-precision (APL) quantisation of expert weight matrices, every row at once.

Algorithm (after Any-Precision LLM, Park et al. 2024), per output row of a block:
1. Seed: a weighted 1-D k-means with 2^3 centroids over the row's weights. The weight of
   column c is h[c], the diagonal of the input Hessian (mean squared input of column c),
   so the clusters minimise sum_c h[c] * (w[c] - centroid)^2, the error the layer's
   output actually sees.
2. Upscaling to 4 bits: every cluster of the 3-bit quantiser is split in two by a
   weighted 1-D 2-means over its own members only. Child 2p holds the smaller values
   of parent p and child 2p+1 the larger (until step 4), so a weight's 4-bit code is its
   3-bit code followed by one more bit.
3. LUT_3[row] holds the weighted means of the 3-bit clusters, rounded to fp16.
4. LUT_4 and the 4-bit codes, for every width that reads them (cell_fit.py): the format
   derives the 5..8-bit values from LUT_4's cells (apl_format.expand_lut: equal sub-intervals
   of each cell), so the 4-bit means alone put a 5-bit value a quarter cell from a weight
   that sits on its centroid. LUT_4's 16 centroids and extent minimise the 4-bit error plus
   the 5..8-bit errors, and each weight takes the child of its 3-bit cluster that lowers
   that sum (the 3-bit codes stay, so the codes stay nested).
5. Refinement, 5..8 bits: a weight's 4 low code bits are the index of the 1/16 sub-interval
   of its cell it falls in (clamped to the cell). Floor of a uniform grid nests, so the top b
   bits of that 8-bit code pick the nearest b-bit value in the weight's cell at every width.
With `error_feedback`, step 1's codes are chosen column by column against the seed LUT
with GPTQ's error feedback through the full input Hessian (error_feedback.py) instead of
nearest-centroid; the LUT_3 stays the seed's and step 2 splits those clusters, so the
codes stay nested.
With `lut_refit_bits`, those widths' LUTs are then refitted per row by least squares under
the full input Hessian, with a ridge toward the bucket means (lut_refit.py); the codes,
hence the planes and the nesting, are unchanged. A refitted LUT_4 is fitted for 5..8 bits
once more (step 4, the codes kept), its 4-bit error priced by the refit's own system.

Everything is vectorised over all rows of all blocks passed in: 1-D assignment to
sorted centroids is a `searchsorted` against the midpoints, and cluster sums are
`scatter_add`s over (row, code) pairs. Works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import (
    BASE_LUT_BITS, BIT_WIDTHS, LUT_DTYPE, LUT_WIDTHS, MAX_BITS, MIN_BITS, expand_lut, refinement_bits, with_extent,
)
from pagedweight.offline.cell_fit import fit_cells
from pagedweight.offline.error_feedback import feedback_codes
from pagedweight.offline.lut_refit import PRODUCTS, refit_luts


@dataclass(frozen=True)
class QuantizerConfig:
    seed_iters: int = 24  # Lloyd iterations of the 3-bit seed k-means
    split_iters: int = 6  # 2-means iterations per cluster split
    # Importance weights below floor * mean(importance) of the row are raised to it: a
    # column no calibration token excites still gets a say in where centroids go.
    importance_floor: float = 1e-3
    # GPTQ error feedback at the 3-bit seed width (needs the full input Hessians, which
    # the calibration then records); dampening: this fraction of the mean diagonal. 3.0,
    # not the 0.1 that was best for one width alone (docs/quantize.md): under
    # nesting a gentler feedback keeps the seed clusters tighter, so the 4-6-bit splits
    # lose less. Widths whose LUTs are refitted under the full input Hessian
    # (lut_refit.py; () = off), and the ridge toward the bucket means (in units of each
    # bucket's diagonal mass; 0.1-0.3 was best held out, 0 overfits at 5-6 bits). The
    # defaults: the one combination measured to lower the planner's mean KL against plain
    # k-means at every budget (25-50 %) on micro-mixtral, tiny-mixtral and tiny-qwen-moe
    # (docs/quantize.md, "Error feedback and LUT refit"); KMEANS_ONLY turns both off.
    error_feedback: bool = True
    feedback_damp: float = 3.0
    lut_refit_bits: tuple[int, ...] = LUT_WIDTHS
    lut_ridge: float = 0.3
    # The arithmetic of the refit's one large product, H S^T (lut_refit.PRODUCTS): float64,
    # float32, or bf16x3 (three bfloat16 terms summing to H, on CUDA's tensor cores with a
    # float32 output). float64 stays the default: on the H200 the refit of a Qwen-shaped
    # tile is not bound by that product (bf16x3: 2-12 % less time per stack, measured), and
    # bf16x3's LUTs were checked against float64 on the CPU only (tiny-qwen-moe: planes
    # identical, 10 of 7.4 M entries one fp16 step off; float32: 0.04 %, up to 9 steps);
    # docs/quantize.md, "What the new default costs at real shape".
    lut_refit_product: str = "float64"
    # LUT_4 fitted for the 5-8-bit values too (cell_fit.py): alternating passes (0: LUT_4 is
    # the 4-bit table alone; 2 passes: +39% quantisation time on tiny-qwen-moe, 1 pass +21%
    # with less of the gain), and each wider width's weight against the 4-bit objective: 2 and
    # 4 at 7 and 8 bits, whose errors are 16 and 64 times smaller than the 5-bit one, so that
    # they have a say (docs/apl_format.md, "What we tried").
    cell_fit_iters: int = 2
    cell_fit_weights: tuple[float, ...] = (1.0, 1.0, 2.0, 4.0)

    def __post_init__(self):
        object.__setattr__(self, "lut_refit_bits", tuple(self.lut_refit_bits))  # a list from JSON
        object.__setattr__(self, "cell_fit_weights", tuple(self.cell_fit_weights))
        if len(self.cell_fit_weights) != MAX_BITS - BASE_LUT_BITS or min(self.cell_fit_weights) < 0:
            raise UserError(f"cell fit weights {list(self.cell_fit_weights)}: one weight >= 0 for each of "
                            f"{BASE_LUT_BITS + 1}..{MAX_BITS} bits")
        if not set(self.lut_refit_bits) <= set(LUT_WIDTHS):
            raise UserError(f"LUT refit widths {list(self.lut_refit_bits)}: only the stored LUTs "
                            f"{list(LUT_WIDTHS)} can be refitted (wider widths derive from LUT_{BASE_LUT_BITS})")
        if self.lut_refit_product not in PRODUCTS:
            raise UserError(f"unknown LUT refit product {self.lut_refit_product!r}; known: {', '.join(PRODUCTS)}")

    @property
    def needs_full_hessians(self) -> bool:
        """Whether the calibration must record every expert's full input Hessian."""
        return self.error_feedback or bool(self.lut_refit_bits)


# The quantiser without error feedback and LUT refit (the ablation): the weighted
# k-means seed, nearest-centroid codes, bucket-mean LUT_3 and LUT_4 fitted for 4-8 bits
# (the cell fit needs only the Hessian diagonal); needs no full Hessians.
KMEANS_ONLY = QuantizerConfig(error_feedback=False, lut_refit_bits=())


@dataclass
class QuantizedRows:
    codes: torch.Tensor  # uint8 [R, C], 8-bit nested codes
    luts: dict[int, torch.Tensor]  # stored LUT width (3, 4) -> fp16 [R, 2^width]


def quantize_rows(w: torch.Tensor, importance: torch.Tensor,
                  config: QuantizerConfig = KMEANS_ONLY,
                  feedback: torch.Tensor | None = None, hessians: torch.Tensor | None = None,
                  seed: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantizedRows:
    """w [R, C] (any float dtype), importance [R, C] or [C] (>= 0) -> nested codes and LUTs.

    feedback: U [G, C, C] (error_feedback.feedback_factors) for G equal groups of
    consecutive rows (the experts of a stack): the seed codes take GPTQ's error feedback.
    hessians: the full input Hessians [G, C, C] of the same groups, which
    `config.lut_refit_bits` refits those widths' LUTs under.
    seed: (centroids [R, 2^MIN_BITS], codes [R, C]) of the seed width, when the caller made
    them already (layer_quantize.quantize_experts runs the feedback over more experts at
    once than a k-means tile holds); `feedback` is then not used.
    """
    w = w.float()
    imp = row_importance(w, importance, config)
    if seed is not None:  # the seed width's LUT and codes, made by the caller (seed_codes)
        centroids, codes = seed[0], seed[1].long()
    else:
        centroids = seed_centroids(w, imp, config)
        codes = _assign(w, centroids) if feedback is None else seed_feedback_codes(w, centroids, feedback).long()
    luts = {MIN_BITS: centroids}
    for bits in range(MIN_BITS, BASE_LUT_BITS):
        codes, centroids = _split_clusters(w, imp, codes, centroids, config.split_iters)
        luts[bits + 1] = centroids
    lut4 = with_extent(luts[BASE_LUT_BITS], w)
    if config.cell_fit_iters:  # the 4-bit codes and LUT_4 chosen for the 5-8-bit values too
        lut4, codes = fit_cells(w, imp, codes, lut4, config.cell_fit_iters, config.cell_fit_weights)
    codes4 = codes
    codes = codes << (MAX_BITS - BASE_LUT_BITS)  # 8-bit codes with the refinement bits still 0
    if config.lut_refit_bits:
        if hessians is None:
            raise UserError("the LUT refit needs the full input Hessians (pass them, or quantise with KMEANS_ONLY)")
        refit4 = BASE_LUT_BITS in config.lut_refit_bits
        curvature = None  # the refit's 4-bit system, which the second cell fit prices LUT_4 by
        if refit4 and config.cell_fit_iters:
            cells = 1 << BASE_LUT_BITS
            # the refit starts from (and pulls toward) the bucket means of the fitted 4-bit codes
            luts[BASE_LUT_BITS] = _weighted_means(w, imp, codes4, cells, lut4[:, :-1].float())
            curvature = {BASE_LUT_BITS: torch.empty(w.shape[0], cells, cells, dtype=torch.float64, device=w.device)}
        luts = refit_luts(w, codes, luts, hessians, config.lut_ridge, config.lut_refit_bits, config.lut_refit_product,
                          curvature)
        if refit4:
            lut4 = with_extent(luts[BASE_LUT_BITS], w)
            if curvature:  # fitted again, its 4-bit error priced by the refit's own system
                anchor = (curvature[BASE_LUT_BITS], luts[BASE_LUT_BITS])
                lut4, _ = fit_cells(w, imp, codes4, lut4, config.cell_fit_iters, config.cell_fit_weights, anchor)
    luts = {MIN_BITS: luts[MIN_BITS].to(LUT_DTYPE), BASE_LUT_BITS: lut4}
    codes = codes | refinement_bits(w, codes4, lut4)
    return QuantizedRows(codes.to(torch.uint8), luts)


def row_importance(w: torch.Tensor, importance: torch.Tensor, config: QuantizerConfig) -> torch.Tensor:
    """importance [R, C] or [C] -> [R, C] with each row's floor applied (k-means' weights)."""
    imp = importance.float().expand_as(w)
    return torch.maximum(imp, config.importance_floor * imp.mean(dim=1, keepdim=True).clamp_min(1e-30))


def seed_centroids(w: torch.Tensor, imp: torch.Tensor, config: QuantizerConfig) -> torch.Tensor:
    """The seed width's LUT [R, 2^MIN_BITS] per row (weighted k-means, rows independent)."""
    return _seed_kmeans(w.float(), imp, 1 << MIN_BITS, config.seed_iters)


def seed_feedback_codes(w: torch.Tensor, centroids: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
    """w [R, C], centroids [R, K], feedback U [G, C, C] for G equal groups of rows -> the
    seed codes [R, C] with GPTQ's error feedback (error_feedback.feedback_codes)."""
    G, (R, C) = feedback.shape[0], w.shape
    return feedback_codes(w.float().view(G, R // G, C), feedback, centroids.view(G, R // G, -1)).view(R, C)


def _weighted_means(w, imp, codes, num_clusters, fallback):
    """Per (row, cluster) weighted mean of w; clusters with no members keep `fallback`."""
    rows = w.shape[0]
    flat = codes + torch.arange(rows, device=w.device)[:, None] * num_clusters
    sums = torch.zeros(rows * num_clusters, device=w.device).scatter_add_(0, flat.reshape(-1), (w * imp).reshape(-1))
    mass = torch.zeros(rows * num_clusters, device=w.device).scatter_add_(0, flat.reshape(-1), imp.reshape(-1))
    sums, mass = sums.view(rows, num_clusters), mass.view(rows, num_clusters)
    return torch.where(mass > 0, sums / mass.clamp_min(1e-30), fallback)


def _assign(w, centroids):
    """Nearest of the sorted centroids [R, K] for every weight of w [R, C]."""
    midpoints = (centroids[:, 1:] + centroids[:, :-1]) / 2
    return torch.searchsorted(midpoints.contiguous(), w.contiguous())


def _seed_kmeans(w, imp, num_clusters, iters):
    """Weighted Lloyd iterations per row, started from evenly spaced quantiles."""
    q = (torch.arange(num_clusters, device=w.device, dtype=torch.float32) + 0.5) / num_clusters
    centroids = torch.quantile(w, q, dim=1).T.contiguous()  # [R, K], sorted
    for _ in range(iters):
        codes = _assign(w, centroids)
        new = _weighted_means(w, imp, codes, num_clusters, centroids)
        new, _ = torch.sort(new, dim=1)  # an empty cluster could break the order
        if torch.equal(new, centroids):
            break
        centroids = new
    return centroids


def _split_clusters(w, imp, codes, centroids, iters):
    """One upscaling step: split every cluster p into children 2p (low) and 2p+1 (high).

    Each parent's members are divided by a threshold t_p (start: the parent's weighted
    mean); 2-means moves t_p to the midpoint of the two children's means. A weight's
    new bit is (w > t_p), so members never leave their parent.
    """
    num_parents = centroids.shape[1]
    thresholds = centroids
    parent_of = codes
    for _ in range(iters + 1):
        high = (w > torch.gather(thresholds, 1, parent_of)).long()
        child = parent_of * 2 + high
        # An empty child takes its parent's centroid, so LUT entries are always defined.
        fallback = centroids.repeat_interleave(2, dim=1)
        children = _weighted_means(w, imp, child, 2 * num_parents, fallback)
        thresholds = (children[:, 0::2] + children[:, 1::2]) / 2
    return child, children


def dequantize_rows(q: QuantizedRows, bits: int) -> torch.Tensor:
    """fp32 [R, C] weights of the b-bit quantiser (for error tables; the format's own
    `dequantize` reads packed planes and is what the model runs)."""
    codes = q.codes.long() >> (MAX_BITS - bits)
    return torch.gather(expand_lut(q.luts[min(bits, BASE_LUT_BITS)], bits).float(), 1, codes)


def column_sq_errors(w: torch.Tensor, q: QuantizedRows) -> dict[int, torch.Tensor]:
    """bits -> [C]: sum over rows of (w - Q_b(w))^2 per input column.

    S(b) = h . err[b] for any Hessian diagonal h over the same columns, so per-prompt
    sensitivities come from these vectors without re-quantising.
    """
    w = w.float()
    return {b: ((w - dequantize_rows(q, b)) ** 2).sum(dim=0) for b in BIT_WIDTHS}


def uniform_grid_rows(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest on a uniform min..max grid per row (the baseline k-means must beat)."""
    w = w.float()
    lo, hi = w.min(dim=1, keepdim=True).values, w.max(dim=1, keepdim=True).values
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-12)
    return torch.round((w - lo) / scale).clamp(0, levels) * scale + lo
