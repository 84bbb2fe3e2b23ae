"""Per-row LUT refit under the full input Hessian, with a ridge toward the bucket means.

The nested quantiser (apl_quantizer.py) sets every LUT entry to the h-weighted mean of its
bucket (the weights whose code selects it), which is optimal only when the columns' errors
do not interact (H diagonal). With the codes fixed, the LUT minimising the block's output
error (w - lut[codes]) H (w - lut[codes])^T solves (S H S^T) lut = S H w, S the one-hot
[K, C] of the row's codes. Solved alone that overfits: an entry few weights use comes from
a nearly singular S H S^T and extrapolates (without it the held-out
block error rose 1.3-3x at 4 bits on tiny-qwen-moe). The ridge pulls each entry toward its
bucket mean with the bucket's own diagonal mass m_k = sum_{c in k} H[c, c]:

    (S H S^T + ridge * diag(m)) lut = S H w + ridge * m * bucket_mean

so ridge -> infinity gives the bucket means back, and for a diagonal H the two agree at
any ridge (the refit only moves entries because of the off-diagonal of H). Codes are not
touched, so every width still reads the same planes (the format's nesting).

Cost: S H S^T for every row at the widest refitted width, by a one-hot matmul in float64
(2 x rows x K x C^2 flops), in chunks of rows; the narrower widths' systems are sums of its
2x2 blocks (a b-bit bucket is the union of two (b+1)-bit buckets). The systems of many
chunks are gathered and solved together, one batched solve per width for up to
_SOLVE_ELEMENTS: on a GPU a Qwen-shaped tile made 44 chunks x 4 widths of small batched
solves, each with its own launches and host sync, and those, not the product, were most of
the refit's time (docs/quantize.md). Rows are independent in every step, so how rows are
chunked or batched for the solve changes no value (test_tiles_and_row_chunks_change_nothing). float64 by default so
that the chunking (which the tiles decide) cannot move a LUT entry by an fp16 step: the
streaming and whole-model quantisers must write the same LUTs. `product` can make the large
product H S^T float32-accurate instead (bf16x3: three bfloat16 terms; float32); the rest
(S H S^T from it, the solves) stays float64. Measured (docs/quantize.md, "What the new
default costs at real shape"): bf16x3 is within one fp16 step of float64 on the shared
models, float32 not (up to 9), and on the H200 neither makes the refit much faster.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import MAX_BITS

_CHUNK_ELEMENTS = 1 << 25  # rows x K x C of the one-hot product held at once (256 MB per float64 temporary)
_SOLVE_ELEMENTS = 1 << 25  # rows x K^2 of the widest width's systems solved in one batch (256 MB)


PRODUCTS = ("float64", "float32", "bf16x3")


def refit_luts(w: torch.Tensor, codes: torch.Tensor, luts: dict[int, torch.Tensor], hessians: torch.Tensor,
               ridge: float, widths: tuple[int, ...], product: str = "float64",
               curvature: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """w [R, C] fp32, codes [R, C] 8-bit nested codes, luts bits -> [R, 2^bits] (the bucket
    means), hessians [G, C, C] for G equal groups of consecutive rows -> the same dict
    with the `widths` refitted (float32; others unchanged). Unused entries keep their value.
    product: the arithmetic of H S^T, the refit's only large cost (bucket_systems).
    curvature: bits -> [R, 2^bits, 2^bits] float64 to fill with each row's system matrix
    (a + ridge diag(mass), solve_ridge's), the Hessian of that width's refit objective in
    the LUT entries (cell_fit.py prices moving them by it)."""
    R, C = w.shape
    G = hessians.shape[0]
    rows_per_group = R // G
    K = 1 << max(widths)
    chunk = max(1, _CHUNK_ELEMENTS // (K * C))
    block = max(chunk, _SOLVE_ELEMENTS // (K * K))  # rows whose systems are solved together
    fitted = {b: torch.empty(luts[b].shape, dtype=torch.float32, device=w.device) for b in widths}
    if product not in PRODUCTS:
        raise ValueError(f"unknown refit product {product!r}; known: {', '.join(PRODUCTS)}")
    h, parts = None, None
    for first in range(0, R, block):
        stop = min(first + block, R)
        # bits -> (S H S^T, S H w, mass) of rows first..stop, filled chunk by chunk
        systems = {b: (torch.empty(stop - first, 1 << b, 1 << b, dtype=torch.float64, device=w.device),
                       torch.empty(stop - first, 1 << b, dtype=torch.float64, device=w.device),
                       torch.empty(stop - first, 1 << b, dtype=torch.float64, device=w.device)) for b in widths}
        for rows in _chunks(first, stop, rows_per_group, chunk):
            g = rows.start // rows_per_group
            if h is None or g != h[0]:  # the group's Hessian (and its bf16x3 parts), once per group
                h = (g, hessians[g].double())
                parts = hessian_parts(h[1], product)
            local = slice(rows.start - first, rows.stop - first)
            for b, system in bucket_systems(w[rows], codes[rows], h[1], widths, parts).items():
                for target, value in zip(systems[b], system):
                    target[local] = value
        for b in widths:
            fitted[b][first:stop] = solve_ridge(*systems[b], luts[b][first:stop].double(), ridge).float()
            if curvature is not None and b in curvature:
                curvature[b][first:stop] = systems[b][0] + torch.diag_embed(ridge_pull(systems[b][2], ridge))
    return {**luts, **fitted}


def _chunks(first: int, stop: int, rows_per_group: int, chunk: int):
    """Row slices of first..stop of at most `chunk` rows, none crossing a group's end
    (a chunk's rows share one Hessian)."""
    start = first
    while start < stop:
        end = min(start + chunk, stop, (start // rows_per_group + 1) * rows_per_group)
        yield slice(start, end)
        start = end


def hessian_parts(h: torch.Tensor, product: str) -> list[torch.Tensor] | None:
    """h [C, C] float64 -> the terms H S^T is summed from (None: one float64 product).
    bf16x3: three bfloat16 matrices whose sum is H to about 2^-24 relative (each the
    rounding of what the earlier ones leave); times a one-hot S^T, exact in bfloat16, with
    float32 accumulation, they give a float32-accurate H S^T on the tensor cores."""
    if product == "float64":
        return None
    if product == "float32":
        return [h.float()]
    parts, rest = [], h.float()
    for _ in range(3):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()
    return parts


def _times_one_hot(parts: list[torch.Tensor], one_hot: torch.Tensor) -> torch.Tensor:
    """sum_i parts[i] @ one_hot, one_hot [C, N] of 0/1 -> [C, N] float64, each product
    accumulated in float32 (bfloat16 parts: on CUDA by the tensor cores with a float32
    output; elsewhere by a float32 product of the same bfloat16 values)."""
    out = None
    for p in parts:
        term = None
        if p.dtype == torch.bfloat16 and p.is_cuda:
            try:
                term = torch.mm(p, one_hot.to(torch.bfloat16), out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch without mm(out_dtype=): the same sums in float32
                term = None
        if term is None:
            term = torch.mm(p.float(), one_hot.float())
        out = term.double() if out is None else out + term.double()
    return out


def bucket_systems(w: torch.Tensor, codes: torch.Tensor, h: torch.Tensor,
                   widths: tuple[int, ...],
                   parts: list[torch.Tensor] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rows w [r, C] sharing one Hessian h [C, C] -> bits -> (S H S^T [r, K, K], S H w [r, K],
    bucket mass [r, K]) in float64, for every width in `widths`. parts (hessian_parts):
    H S^T from those terms instead of one float64 product."""
    top = max(widths)
    K = 1 << top
    h = h.double()
    r, C = codes.shape
    top_codes = codes.long() >> (MAX_BITS - top)
    # one [C, C] x [C, r K] product, the rows side by side (r products of [C, C] x [C, K] took
    # twice as long on a CPU, with the same sums)
    if parts is None:
        # the one-hot [C, r, K] made in float64 at once (F.one_hot's int64 would be a second copy)
        one_hot_t = torch.zeros(C, r, K, dtype=torch.float64, device=codes.device).scatter_(2, top_codes.T[..., None], 1.0)
        hs = (h @ one_hot_t.view(C, r * K)).view(C, r, K).transpose(0, 1)
        one_hot = one_hot_t.transpose(0, 1)
    else:
        one_hot_t = torch.nn.functional.one_hot(top_codes.T, K).to(parts[0].dtype)  # [C, r, K]
        hs = _times_one_hot(parts, one_hot_t.reshape(C, r * K)).view(C, r, K).transpose(0, 1)
        one_hot = one_hot_t.transpose(0, 1).double()
    a = one_hot.transpose(1, 2) @ hs
    rhs = torch.bmm(w.double()[:, None, :], hs)[:, 0]  # S H w, H symmetric (no [r, C, K] temporary)
    mass = h.diagonal() @ one_hot
    out = {}
    for b in range(top, min(widths) - 1, -1):
        if b in widths:
            out[b] = (a, rhs, mass)
        # the (b-1)-bit bucket k is the union of b-bit buckets 2k and 2k+1
        a = a.unflatten(1, (-1, 2)).sum(2).unflatten(2, (-1, 2)).sum(3)
        rhs, mass = rhs.unflatten(1, (-1, 2)).sum(2), mass.unflatten(1, (-1, 2)).sum(2)
    return out


def ridge_pull(mass: torch.Tensor, ridge: float) -> torch.Tensor:
    """The ridge's weight per bucket [r, K]: ridge * mass, and for an empty bucket a tiny multiple
    of the row's mean mass, so its system stays solvable."""
    return ridge * mass + 1e-6 * mass.mean(1, keepdim=True).clamp_min(1e-30)


def solve_ridge(a: torch.Tensor, rhs: torch.Tensor, mass: torch.Tensor, means: torch.Tensor,
                ridge: float) -> torch.Tensor:
    """(a + ridge diag(mass)) lut = rhs + ridge mass means per row [r, K]; an empty bucket
    (mass 0, its row of a zero) keeps its mean (ridge_pull)."""
    pull = ridge_pull(mass, ridge)
    lut = torch.linalg.solve(a + torch.diag_embed(pull), (rhs + pull * means)[..., None])[..., 0]
    return torch.where(mass > 0, lut, means)
