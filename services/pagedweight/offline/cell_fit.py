"""LUT_4 fitted for every width that reads it: the 4-bit centroids and the extent chosen with
the 5-8-bit values' error in the objective.

From 5 bits up the format derives a weight's value from its 4-bit cell (apl_format.expand_lut):
code p << s | j is the centre of sub-interval j of cell p, whose bounds are midpoints between
neighbouring centroids (the outer ones `e` beyond theirs). With the codes fixed that value is
affine in LUT_4's 17 entries theta = (c_0..c_15, e):

    value = (u_p + f * d_p) . theta,    f = (j + 1/2) / 2^s

(inner p: u_p = (e_{p-1} + e_p) / 2, d_p = (e_{p+1} - e_{p-1}) / 2; the outer cells bring e in).
The bucket means (or the LUT refit) that LUT_4 starts from are the best 4-bit table, blind to
where its cells put the wider widths' values: on rows whose important weights sit at their
centroid, every 5-bit value is a quarter cell away (0.087 against 0.019 at 4 bits on heavy-tailed
rows), and a value with an empty neighbour sits on its cell's edge, where no sub-interval centre
is. So theta minimises

    J(theta) = (c - c*)^T A (c - c*) + sum_{b=5..8} lam_b sum_c h_c (w_c - value_b(c))^2

where the first term is the 4-bit objective around its optimum c* (A: diag of the buckets'
importance mass, or the refit's system under the full input Hessian, so the 4-bit error the
refit bought is priced as it measured it) and the rest are the wider widths' importance-weighted
errors (the quantizer weighs 5..8 bits 1, 1, 2, 4: 7 and 8 bits' errors are small enough that
weight 1 leaves them no say). Lloyd-style, a few passes of: the refinement codes (nearest value
in the cell: apl_format.refinement_bits), then theta, a least-squares step, neither raising J.
Without the refit's anchor a pass also moves each weight to the child of its 3-bit cluster that
lowers its share of J (the 3-bit codes, hence the nesting, stay), and the refit then runs on those
codes and anchors a second fit that keeps them. A row keeps its start unless the fitted LUT
(rounded to fp16, sorted, e >= 0) lowers J. LUT_3 and the format are untouched: only which 4-bit
child a weight takes and the 17 numbers a row stores change.

The wider widths' sums come from per-8-bit-code moments of the row (importance mass and
importance-weighted sum of w), one `index_add` a pass: a code's value at every width is a
function of its low bits, so each width's normal equations are fixed combinations of those sums.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import BASE_LUT_BITS, LUT_DTYPE, MAX_BITS, cell_bounds, refinement_bits

_CELLS = 1 << BASE_LUT_BITS
_SUB = 1 << (MAX_BITS - BASE_LUT_BITS)  # 8-bit refinement steps per cell
_WIDE = tuple(range(BASE_LUT_BITS + 1, MAX_BITS + 1))


def _cell_vectors(device) -> tuple[torch.Tensor, torch.Tensor]:
    """u, d [16, 17]: cell p's b-bit value is (u_p + f d_p) . theta (theta = centroids, extent)."""
    u = torch.zeros(_CELLS, _CELLS + 1, dtype=torch.float64, device=device)
    d = torch.zeros_like(u)
    p = torch.arange(1, _CELLS - 1, device=device)
    u[p, p - 1] = u[p, p] = 0.5
    d[p, p - 1], d[p, p + 1] = -0.5, 0.5
    last, extent = _CELLS - 1, _CELLS
    u[0, 0], u[0, extent] = 1.0, -1.0  # low bound c_0 - e, high (c_0 + c_1) / 2
    d[0, 0], d[0, 1], d[0, extent] = -0.5, 0.5, 1.0
    u[last, last - 1] = u[last, last] = 0.5  # low (c_14 + c_15) / 2, high c_15 + e
    d[last, last - 1], d[last, last], d[last, extent] = -0.5, 0.5, 1.0
    return u, d


def _fractions(device) -> torch.Tensor:
    """[widths 5..8, 16]: f of each 8-bit refinement code j at every wider width."""
    j = torch.arange(_SUB, device=device)
    return torch.stack([((j >> (MAX_BITS - b)) + 0.5) / (1 << (b - BASE_LUT_BITS)) for b in _WIDE]).double()


def _cell_sums(cells, sub, masses, z, lam, frac):
    """Per (row, cell) sums over the cell's weights and widths 5..8 of lam_b h f^k (k = 0, 1, 2),
    lam_b h w f^k (k = 0, 1) and lam_b h w^2: with value = base + slope f, the wider widths'
    error of a cell is z - 2 (base y0 + slope y1) + base^2 a0 + 2 base slope a1 + slope^2 a2.
    cells [R, C]: row * 16 + 4-bit code; sub [R, C]: 8-bit refinement codes; masses [R*C, 2]: the
    importance h and h w (float64); z [R, 16]: sum of h w^2 per cell.
    Gathered per 8-bit code first (f depends on the code's low bits only): one index_add."""
    R = cells.shape[0]
    flat = (cells * _SUB + sub).reshape(-1)
    m = torch.zeros(R * _CELLS * _SUB, 2, dtype=torch.float64, device=masses.device).index_add_(0, flat, masses)
    m = m.view(R, _CELLS, _SUB, 2)
    weights = torch.stack([lam.sum().expand(_SUB), lam @ frac, lam @ frac ** 2], dim=1)  # [16, 3]: f^0, f^1, f^2
    return m[..., 0] @ weights, m[..., 1] @ weights[:, :2], lam.sum() * z


def _per_cell(cells, x):
    """sum of x [R*C] per (row, cell) [R, 16]."""
    R = cells.shape[0]
    out = torch.zeros(R * _CELLS, dtype=torch.float64, device=x.device)
    return out.index_add_(0, cells.reshape(-1), x).view(R, _CELLS)


def _objective(theta, sums, anchor, target, u, d):
    """J per row [R] (float64)."""
    (a, y, z), dc = sums, theta[:, :_CELLS] - target
    base, slope = theta @ u.T, theta @ d.T  # [R, 16]
    wide = (z - 2 * (base * y[..., 0] + slope * y[..., 1])
            + base ** 2 * a[..., 0] + 2 * base * slope * a[..., 1] + slope ** 2 * a[..., 2]).sum(1)
    return torch.einsum("ri,rij,rj->r", dc, anchor, dc) + wide


def _solve(sums, anchor, target, u, d, theta):
    """The theta minimising J for the codes the sums were taken with [R, 17]."""
    a, y, _ = sums
    # sum_p a0 u u^T + a1 (u d^T + d u^T) + a2 d d^T, as one product with the cells' outer products
    outer = torch.stack([u[:, :, None] * u[:, None], u[:, :, None] * d[:, None] + d[:, :, None] * u[:, None],
                         d[:, :, None] * d[:, None]], dim=1)  # [16, 3, 17, 17]
    normal = (a.reshape(a.shape[0], -1) @ outer.reshape(-1, (_CELLS + 1) ** 2)).view(-1, _CELLS + 1, _CELLS + 1)
    rhs = y[..., 0] @ u + y[..., 1] @ d
    normal[:, :_CELLS, :_CELLS] += anchor
    rhs[:, :_CELLS] += (anchor @ target[..., None])[..., 0]
    # a tiny pull toward the current LUT keeps rows with unused cells solvable
    eps = 1e-9 * normal.diagonal(dim1=1, dim2=2).mean(1, keepdim=True).clamp_min(1e-30)
    normal = normal + torch.diag_embed(eps.expand(-1, _CELLS + 1))
    # symmetric positive definite: a Cholesky solve (a row whose factorisation fails keeps theta)
    chol, info = torch.linalg.cholesky_ex(normal)
    solved = torch.cholesky_solve((rhs + eps * theta)[..., None], chol)[..., 0]
    return torch.where((info == 0)[:, None], solved, theta)


def _stored(theta):
    """theta [R, 17] -> what LUT_4 stores (fp16) and whether it is a valid table (finite, sorted
    centroids, extent >= 0)."""
    lut = theta.to(LUT_DTYPE)
    f = lut.double()
    ok = torch.isfinite(f).all(1) & (f[:, 1:_CELLS] >= f[:, :_CELLS - 1]).all(1) & (f[:, _CELLS] >= 0)
    return lut, ok


def _diag_anchor(cells, h, hw, z, centroids):
    """The 4-bit importance-weighted error written (c - c*)^T diag(m) (c - c*) + const:
    (diag(m) [R, 16, 16], c* [R, 16] (an empty bucket: `centroids`), const [R])."""
    m, y = _per_cell(cells, h), _per_cell(cells, hw)
    mean = torch.where(m > 0, y / m.clamp_min(1e-300), centroids.double())
    return torch.diag_embed(m), mean, (z - y * mean).sum(1)


def _nearest_child(w, codes4, lut, lam):
    """Each weight's 4-bit code: of the two children of its 3-bit cluster, the one whose 4-bit
    value and 5-8-bit values (weighted 1 and lam) lie nearest it (its importance is the same
    factor on both, so it does not enter); and its refinement code in that child's cell."""
    low, high = cell_bounds(lut)
    first = (codes4 >> 1) << 1
    cost, subs = [], []
    for child in (first, first + 1):
        lo, width = torch.gather(low, 1, child), torch.gather(high - low, 1, child)
        sub = refinement_bits(w, child, lut)
        total = (w - torch.gather(lut.float(), 1, child)) ** 2
        for weight, b in zip(lam.tolist(), _WIDE):
            value = lo + width * (((sub >> (MAX_BITS - b)) + 0.5) / (1 << (b - BASE_LUT_BITS)))
            total = total + weight * (w - value) ** 2
        cost.append(total)
        subs.append(sub)
    high_child = cost[1] < cost[0]
    return first + high_child.long(), torch.where(high_child, subs[1], subs[0])


def fit_cells(w: torch.Tensor, imp: torch.Tensor, codes4: torch.Tensor, lut4: torch.Tensor, iters: int,
              width_weights: tuple[float, ...],
              anchor: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w, imp [R, C], codes4 [R, C] (4-bit codes), lut4 [R, 17] fp16 (the start), width_weights
    (lam of widths 5..8) -> (the fitted LUT_4 [R, 17] fp16, the 4-bit codes [R, C]).

    anchor: (A [R, 16, 16], c* [R, 16]), the 4-bit objective as the LUT refit measured it under
    the full input Hessian for these codes, which then stay. None: the importance-weighted 4-bit
    error, and each pass also moves a weight to the other child of its 3-bit cluster where that
    lowers its share of J (the 3-bit codes, hence the nesting, stay).
    """
    w, imp = w.float(), imp.float()
    R, dev = w.shape[0], w.device
    u, d, frac = *_cell_vectors(dev), _fractions(dev)
    lam = torch.tensor(width_weights, dtype=torch.float64, device=dev)
    h, hw = imp.double().reshape(-1), (imp * w).double().reshape(-1)
    hww, masses = hw * w.double().reshape(-1), torch.stack([h, hw], 1)
    rows = torch.arange(R, device=dev)[:, None] * _CELLS
    cells = rows + codes4
    z = _per_cell(cells, hww)
    reassign = anchor is None
    if reassign:
        curvature, target, const = _diag_anchor(cells, h, hw, z, lut4[:, :_CELLS])
    else:
        (curvature, target), const = (t.double() for t in anchor), torch.zeros(R, dtype=torch.float64, device=dev)
    best, best_codes, theta = lut4, codes4, lut4.double()
    sums = _cell_sums(cells, refinement_bits(w, codes4, lut4), masses, z, lam, frac)
    best_j = _objective(theta, sums, curvature, target, u, d) + const
    for _ in range(iters):
        lut, ok = _stored(_solve(sums, curvature, target, u, d, theta))
        theta = lut.double()
        if reassign:
            # (a row whose LUT is no valid table is not kept below, whatever its codes)
            codes4, sub = _nearest_child(w, codes4, lut, lam)
            cells = rows + codes4
            z = _per_cell(cells, hww)
            curvature, target, const = _diag_anchor(cells, h, hw, z, theta[:, :_CELLS])
        else:
            sub = refinement_bits(w, codes4, lut)
        sums = _cell_sums(cells, sub, masses, z, lam, frac)
        j = _objective(theta, sums, curvature, target, u, d) + const
        better = ok & (j < best_j)
        best = torch.where(better[:, None], lut, best)
        best_codes = torch.where(better[:, None], codes4, best_codes)
        best_j = torch.where(better, j, best_j)
    return best, best_codes
