"""Paged decode attention that reads the KV tiles where they are.

One query token per sequence attends to its cached keys/values through tile offsets into
the cache's flat storage (`PagedKVCache.kv_tile_offsets`: where block j's K and V tiles of
one layer start; each tile is [block_size, G, D], contiguous). Nothing is gathered into a
padded [B, S, G, D] copy, nothing depends on host values, so both paths run inside a CUDA
graph, and the work follows each sequence's own length, not the longest one's.

- `paged_decode_triton`: the CUDA path. One program per (sequence, kv head, split): it
  walks its share of the sequence's blocks with an online softmax, for every query head of
  the group at once, and writes an unnormalised partial (max, sum, weighted values). The
  splits (flash-decoding) keep the GPU busy when a few sequences have long contexts; a
  second small kernel (`combine_splits_triton`) merges them in one launch (a torch combine
  takes about eight per layer).
- `paged_decode_torch`: the same arithmetic in plain torch, a chunk of block columns at a
  time (only that chunk's tiles are read), for the CPU and as the kernel's reference.

Both take the tile offsets rather than a block table so the cache layout stays the cache's
business. Shape legend: B sequences, N query heads, G kv heads,
Q = N // G query heads per kv head, D head dim, W block-table width, bs block size.
"""

from __future__ import annotations

import math

import torch

from pagedweight_kernels.cuda_packages import cuda_with, sm_count

# fallbacks (kept small so a CPU step reads a bounded slice of the cache at a time)
TORCH_CHUNK_BLOCKS = 32
# The kernel's tiles per loop iteration (a power of two): 1, as more make the [Q, tiles * bs, D]
# product spill (docs/kernel.md, "What we tried").
TILES_PER_ITER = 1


def _key_mask(context_lens, positions_of_keys, window: int | None, valid=None):
    """[B, S] bool: key p of sequence b is visible to its query at context_len - 1."""
    q_pos = (context_lens - 1)[:, None]
    mask = positions_of_keys[None, :] <= q_pos
    if window is not None:
        mask &= positions_of_keys[None, :] > q_pos - window
    if valid is not None:
        mask &= valid
    return mask


def paged_decode_torch(q: torch.Tensor, flat: torch.Tensor, k_off: torch.Tensor, v_off: torch.Tensor,
                       context_lens: torch.Tensor, block_size: int, kv_heads: int, window: int | None = None,
                       block_table: torch.Tensor | None = None,
                       chunk_blocks: int = TORCH_CHUNK_BLOCKS, scale: float | None = None,
                       row_elems: int | None = None) -> torch.Tensor:
    """q [B, N, D] (one decode query per sequence), tile offsets k_off, v_off [B, W] into
    `flat`, context_lens [B] (tokens in the cache, the query's own included) -> [B, N, D].

    Entries of `block_table` < 0 (released, padding) are masked out; columns past a
    sequence's length are masked by position; `scale` multiplies q.k (None: 1/sqrt(D)).
    `row_elems`: elements from one token's row of a tile to the next (None: G * D); a layer
    narrower than the cache's slot (Gemma-4's full-attention layers) uses each row's front.
    Online softmax over chunks of columns: only one chunk's tiles are read at a time, in
    float32."""
    B, N, D = q.shape
    W = k_off.shape[1]
    if k_off.shape != v_off.shape or k_off.shape[0] != B:
        raise ValueError(f"k_off {tuple(k_off.shape)} and v_off {tuple(v_off.shape)} must be [B={B}, W]")
    bs, G = block_size, kv_heads
    Q = N // G
    qf = q.float().view(B, G, Q, D) * (1.0 / math.sqrt(D) if scale is None else scale)
    m = torch.full((B, G, Q), float("-inf"), device=q.device)
    l_sum = torch.zeros(B, G, Q, device=q.device)
    acc = torch.zeros(B, G, Q, D, device=q.device)
    row = G * D if row_elems is None else row_elems
    within = (torch.arange(bs, device=q.device)[:, None] * row + torch.arange(G * D, device=q.device)).flatten()
    for c0 in range(0, W, chunk_blocks):
        c1 = min(W, c0 + chunk_blocks)
        n = c1 - c0
        k = flat[k_off[:, c0:c1, None] + within].float().view(B, n * bs, G, D)
        v = flat[v_off[:, c0:c1, None] + within].float().view(B, n * bs, G, D)
        key_pos = torch.arange(c0 * bs, c1 * bs, device=q.device)
        valid = None
        if block_table is not None:
            valid = (block_table[:, c0:c1] >= 0).repeat_interleave(bs, dim=1)
        mask = _key_mask(context_lens, key_pos, window, valid)  # [B, n * bs]
        # masked keys may be stale bytes (released blocks, slots past the length, arena pages
        # weights left): zero them so a NaN pattern there cannot reach the sum as 0 * NaN
        k = k.masked_fill(~mask[:, :, None, None], 0.0)
        v = v.masked_fill(~mask[:, :, None, None], 0.0)
        s = torch.einsum("bgqd,bsgd->bgqs", qf, k).masked_fill(~mask[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # a row with no visible key yet keeps m = -inf: use 0 as its reference (all weights 0)
        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - ref[..., None])
        scale = torch.exp(m - ref)
        l_sum = l_sum * scale + p.sum(-1)
        acc = acc * scale[..., None] + torch.einsum("bgqs,bsgd->bgqd", p, v)
        m = m_new
    return (acc / l_sum[..., None]).view(B, N, D).to(q.dtype)


# ---------------------------------------------------------------- the CUDA kernel (Triton)

def num_splits(batch: int, kv_heads: int, width: int, sm_count: int = 132) -> int:
    """Splits per (sequence, kv head): enough programs to fill about four waves of SMs,
    at least 8 blocks each, at most 32. Depends on shapes only (stable under a graph)."""
    want = -(-4 * sm_count // max(1, batch * kv_heads))
    return max(1, min(32, want, -(-width // 8)))


_KERNEL = None
_COMBINE = None


def triton_available() -> bool:
    """True where the Triton kernel can be built (a CUDA device and the triton package)."""
    return cuda_with("triton")


def triton_shape_supported(head_dim: int, block_size: int) -> bool:
    """The kernel's tiles are power-of-two wide (Triton's block shapes): other head dims
    (some tiny test models) take the torch path, which is exact and graph-safe too."""
    return head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def decode_split(q_ptr, flat_ptr, koff_ptr, voff_ptr, table_ptr, ctx_ptr,
                     m_ptr, l_ptr, acc_ptr, out_ptr,
                     W, window, scale,
                     G: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
                     BS: tl.constexpr, NB: tl.constexpr, SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     DIRECT: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        qi = tl.arange(0, QP)
        di = tl.arange(0, D)
        ri = tl.arange(0, NB * BS)  # NB tiles per iteration, BS token rows each
        tile_of = ri // BS
        ti = ri % BS
        q_rows = qi < Q
        # q [B, N, D] with N = G * Q: this group's query heads
        q = tl.load(q_ptr + (b * G * Q + g * Q + qi)[:, None] * D + di[None, :],
                    mask=q_rows[:, None], other=0.0).to(tl.float32) * scale
        ctx = tl.load(ctx_ptr + b)
        q_pos = ctx - 1
        n_blocks = (ctx + BS - 1) // BS
        first = n_blocks * 0
        if HAS_WINDOW:
            first = tl.maximum(q_pos - window + 1, 0) // BS
        per = (n_blocks - first + SPLITS - 1) // SPLITS
        lo = first + s * per
        hi = tl.minimum(lo + per, n_blocks)
        m_i = tl.full([QP], float("-inf"), tl.float32)
        l_i = tl.zeros([QP], tl.float32)
        acc = tl.zeros([QP, D], tl.float32)
        row_in_tile = ti * (G * D) + g * D  # [R] start of each token's head-g row inside its tile
        for j0 in range(lo, hi, NB):
            j = j0 + tile_of
            live = j < hi
            entry = tl.load(table_ptr + b * W + j, mask=live, other=-1)
            k_base = tl.load(koff_ptr + b * W + j, mask=live, other=0)
            v_base = tl.load(voff_ptr + b * W + j, mask=live, other=0)
            key_pos = j * BS + ti
            ok = live & (key_pos <= q_pos) & (entry >= 0)
            if HAS_WINDOW:
                ok = ok & (key_pos > q_pos - window)
            # masked slots may hold stale bytes (NaN patterns): read them as 0
            k = tl.load(flat_ptr + (k_base + row_in_tile)[:, None] + di[None, :],
                        mask=ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(flat_ptr + (v_base + row_in_tile)[:, None] + di[None, :],
                        mask=ok[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [QP, R]
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(sc - ref[:, None])
            alpha = tl.exp(m_i - ref)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        if DIRECT:  # one split: the output itself, normalised, in q's dtype (no combine launches)
            head = b * G * Q + g * Q + qi
            tl.store(out_ptr + head[:, None] * D + di[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=q_rows[:, None])
        else:
            row = (b * G * Q + g * Q + qi) * SPLITS + s  # partials [B, N, SPLITS]
            tl.store(m_ptr + row, m_i, mask=q_rows)
            tl.store(l_ptr + row, l_i, mask=q_rows)
            tl.store(acc_ptr + row[:, None] * D + di[None, :], acc, mask=q_rows[:, None])

    _KERNEL = decode_split
    return _KERNEL


def _combine_kernel():
    global _COMBINE
    if _COMBINE is not None:
        return _COMBINE
    import triton
    import triton.language as tl

    @triton.jit
    def combine_split_rows(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
        r = tl.program_id(0)  # one (sequence, query head) row
        si = tl.arange(0, SP)
        di = tl.arange(0, D)
        live = si < SPLITS
        m = tl.load(m_ptr + r * SPLITS + si, mask=live, other=float("-inf"))
        l_sum = tl.load(l_ptr + r * SPLITS + si, mask=live, other=0.0)
        w = tl.where(live, tl.exp(m - tl.max(m, axis=0)), 0.0)  # empty splits: exp(-inf) = 0
        acc = tl.load(acc_ptr + (r * SPLITS + si)[:, None] * D + di[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + r * D + di, out.to(out_ptr.dtype.element_ty))

    _COMBINE = combine_split_rows
    return _COMBINE


def combine_splits_triton(m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine_splits(m, l_sum, acc).to(dtype)` in one launch (CUDA, contiguous partials,
    a power-of-two D, as decode_split writes them)."""
    B, N, S, D = acc.shape
    out = torch.empty(B, N, D, dtype=dtype, device=acc.device)
    _combine_kernel()[(B * N,)](m, l_sum, acc, out, SPLITS=S, SP=max(2, 1 << (S - 1).bit_length()), D=D,
                                num_warps=4)
    return out


def paged_decode_triton(q: torch.Tensor, flat: torch.Tensor, k_off: torch.Tensor, v_off: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, kv_heads: int,
                        window: int | None = None, block_table: torch.Tensor | None = None,
                        splits: int | None = None, tiles_per_iter: int = TILES_PER_ITER,
                        scale: float | None = None) -> torch.Tensor:
    """The CUDA path of `paged_decode_torch` (same arguments): [B, N, D]. Each loop
    iteration of a program reads `tiles_per_iter` tiles (more bytes in flight)."""
    B, N, D = q.shape
    W = k_off.shape[1]
    G = kv_heads
    Q = N // G
    if not triton_shape_supported(D, block_size):
        raise ValueError(f"the decode kernel needs a power-of-two head dim and block size, got {D}, {block_size}")
    if splits is None:
        splits = num_splits(B, G, W, sm_count(q.device.index))
    table = block_table if block_table is not None else k_off.new_zeros(k_off.shape)
    direct = splits == 1  # the kernel writes the output itself: 2 launches fewer per layer
    if direct:
        out = torch.empty(B, N, D, dtype=q.dtype, device=q.device)
        m = l_sum = acc = out  # not written
    else:
        out = q  # not written
        m = torch.empty(B, N, splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(B, N, splits, D, dtype=torch.float32, device=q.device)
    _kernel()[(B, G, splits)](
        q.contiguous(), flat, k_off.contiguous(), v_off.contiguous(), table.contiguous(), context_lens.contiguous(),
        m, l_sum, acc, out, W, int(window or 0), 1.0 / math.sqrt(D) if scale is None else scale,
        G=G, Q=Q, QP=max(2, 1 << (Q - 1).bit_length()), D=D, BS=block_size, NB=tiles_per_iter, SPLITS=splits,
        HAS_WINDOW=window is not None, DIRECT=direct, num_warps=8 if tiles_per_iter * block_size >= 64 else 4)
    return out if direct else combine_splits_triton(m, l_sum, acc, q.dtype)




def combine_splits(m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Partials m, l [B, N, S], acc [B, N, S, D] (unnormalised) -> [B, N, D] float32.
    A split that saw no key has m = -inf, l = 0, acc = 0 and weighs nothing."""
    if m.shape[-1] == 1:  # one split (large batches): it saw the query's own key; 2 kernels, not 9
        return acc[..., 0, :] / l_sum
    top = m.amax(-1, keepdim=True)
    w = torch.exp(m - top)  # 0 for empty splits (some split always holds the query's own key)
    return (acc * w[..., None]).sum(-2) / (l_sum * w).sum(-1)[..., None]
