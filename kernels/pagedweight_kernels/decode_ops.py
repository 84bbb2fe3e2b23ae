"""Launchers of decode_ops.cu: the fused small kernels of a decode layer.

A decode step at batch 1 is bound by the number of kernels (each a few microseconds over a
few KB), not by bytes. Each function here replaces one chain of torch
launches with one kernel computing the same values, rounding where the chain rounds:

- `add_rms_norm`: the residual add (and Qwen's gated shared expert's add) with the next
  RMSNorm, writing both the new residual and the normalised rows (5-8 launches -> 1);
- `route_topk`: router softmax in fp32, top-k, renormalisation, the casts (4-6 -> 1);
- `gated_rows`: act(gate) * up over a [gate | up] product (2 -> 1);
- `group_rows`: the assignments sorted by expert, the groups' ends and the gathered rows
  of the grouped dense experts (6-7 -> 1); `combine_rows`: back to the tokens, weighted
  and summed over k (3 -> 1);
- `rope_write`: RoPE of q and k from the fused q/k/v product and the new k, v written to
  their places in the paged cache, any tile layout (8-20 -> 1);
- `experts_gemv` (expert_gemv.cu): the routed dense experts at few tokens per expert as two
  GEMVs that group by expert themselves and fold act(gate) * up and the combine in
  (group_rows, two grouped products, gated_rows, combine_rows: 7 launches -> 2).

The references are the torch forms the CPU runs (layers.RMSNorm, SparseMoeBlock.route,
moe_reference.gated / grouped_moe_forward, apply_rotary_signed and PagedKVCache.write):
tests/kernels/test_decode_ops_gpu.py holds each kernel to its reference. Every launch runs
on PyTorch's current stream and reads no host values, so all of them run inside a CUDA
graph capture. Shape legend: T tokens, H hidden, E experts, k top-k, I intermediate.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from pagedweight_kernels.cuda_packages import cuda_with, launch_on_torch_stream, module_source, sm_count

SOURCE = Path(__file__).with_name("decode_ops.cu")
GEMV_SOURCE = Path(__file__).with_name("expert_gemv.cu")  # compiled after SOURCE: uses its helpers
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ACT = {"silu": 0, "gelu_tanh": 1}
THREADS = 256
ROUTE_WARPS = 4  # tokens per routing block (one warp each)
MAX_ROUTE_EXPERTS = 1024  # a warp's probabilities live in shared memory (4 KB)
MAX_TOP_K = 32  # lane j keeps the j-th weight
MAX_GROUP_ASSIGN = 1024  # group_rows sorts in O(n^2 / threads) per block: small n only
GROUP_BLOCKS = 64  # blocks sharing group_rows' row copies
NORM_VPT = (8, 16)  # add_rms_norm's row elements per thread (held in registers)
MAX_NORM_HIDDEN = 16 * 1024  # 16 per thread, 1024 threads
GEMV_THREADS = 256  # expert_gemv.cu's GV_WARPS * 32: one assignment per thread when grouping
MAX_GEMV_ASSIGN = GEMV_THREADS
GEMV_ROWS = 4  # R: an expert's assignments per pass over its weight rows (more: another pass, from L2)
# U: 16-byte vectors per weight row in flight per lane (gate_up reads two rows at once; a
# down row of Qwen1.5-MoE's 1408 columns is 5.5 vectors per lane: one round at 8)
GEMV_UNROLL = {"gate_up": 4, "down": 8}
MAX_GEMV_ROWS_PER_CTA = 8  # expert_gemv.cu's GV_MAX_ROWS_PER_CTA
GEMV_CTAS_PER_SM = 2  # the kernels' __launch_bounds__ occupancy: the persistent grid is one wave
# The dense experts take the GEMV while a step's assignments per expert (T k / E, the mean)
# stay at most this, torch._grouped_mm above: the GEMV is the faster up to about one
# assignment per expert at Qwen1.5-MoE's and Mixtral's expert shapes (docs/real_shape.md).
GEMV_MAX_TOKENS_PER_EXPERT = 1.0


@lru_cache(maxsize=None)
def available() -> bool:
    """True where the kernels can run: a CUDA device and cupy."""
    return cuda_with("cupy")


def _instances() -> list[str]:
    """Every kernel instance the launchers can ask for: compiled together, once."""
    dts = range(len(_DT))
    return ([f"add_rms_norm<{d}, {m}, {v}, 0>" for d in dts for m in range(3) for v in NORM_VPT]
            + [f"add_rms_norm<{d}, 0, {v}, {s}>" for d in dts for v in NORM_VPT for s in (1, 2)]
            + [f"route_topk<{d}, {o}>" for d in dts for o in dts]
            + [f"gated_rows<{d}, {a}>" for d in dts for a in _ACT.values()]
            + ["group_rows"] + [f"combine_rows<{d}, {w}>" for d in dts for w in {d, 0}]
            + [f"rope_write<{d}>" for d in dts]
            + [f"expert_gate_up<{d}, {a}, {GEMV_ROWS}, {GEMV_UNROLL['gate_up']}, {v}>"
               for d in dts for a in _ACT.values() for v in ("true", "false")]
            + [f"expert_down_combine<{d}, {GEMV_ROWS}, {GEMV_UNROLL['down']}, {v}, {w}>"
               for d in dts for v in ("true", "false") for w in {d, 0}])


@lru_cache(maxsize=None)
def _module():
    """One NVRTC compile per process for all instances (a few seconds, paid by the first
    launch: a decode graph's warm-up, never its capture)."""
    import cupy as cp

    return cp.RawModule(code=module_source(SOURCE, GEMV_SOURCE), options=("-std=c++17",),
                        name_expressions=_instances())


@lru_cache(maxsize=None)
def _function(name: str):
    """The compiled instance `name`, e.g. 'add_rms_norm<1, 2>'."""
    return _module().get_function(name)


def _launch(name: str, grid, block: int, args, shared: int = 0) -> None:
    launch_on_torch_stream(_function(name), grid, block, args, shared)


def _dtype_code(t: torch.Tensor, what: str) -> int:
    if t.dtype not in _DT:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {t.dtype}")
    return _DT[t.dtype]


def _check_rows(t: torch.Tensor, shape: tuple, dtype: torch.dtype, what: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or not t.is_cuda:
        raise ValueError(f"{what} must be a contiguous CUDA {dtype} {shape}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (strided)'}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                 shared: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """x, delta, shared [T, H], gate [T, 1] (any row stride) -> (residual, normed) [T, H]:
    residual = x + (delta + sigmoid(gate) * shared) (the terms given), normed = weight *
    rms_norm(residual) (fp32, cast, then scaled). Without delta the residual is x itself."""
    T, H = x.shape
    code = _dtype_code(x, "x")
    _check_rows(x, (T, H), x.dtype, "x")
    _check_rows(weight, (H,), x.dtype, "weight")
    mode = 0 if delta is None else (1 if shared is None else 2)
    if delta is not None:
        _check_rows(delta, (T, H), x.dtype, "delta")
    if mode == 2:
        _check_rows(shared, (T, H), x.dtype, "shared")
        if gate is None or gate.shape != (T, 1) or gate.dtype != x.dtype:
            raise ValueError(f"gate must be {x.dtype} [{T}, 1] beside shared, got "
                             f"{None if gate is None else (gate.dtype, tuple(gate.shape))}")
    if H > MAX_NORM_HIDDEN:
        raise ValueError(f"add_rms_norm takes rows of up to {MAX_NORM_HIDDEN} elements, got {H}")
    residual = x if mode == 0 else torch.empty_like(x)
    out = torch.empty_like(x)
    if T:
        vpt, threads = _norm_shape(H)
        _launch(f"add_rms_norm<{code}, {mode}, {vpt}, 0>", (T,), threads,
                (x, delta, shared, gate, _i64(gate.stride(0) if mode == 2 else 0), weight,
                 None if mode == 0 else residual, out, H, float(eps)))
    return residual, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm over x's last dimension, normalised in fp32 (one launch for every row): with
    `weight`, scaled either after the cast to x's dtype (Llama-style) or before it, in fp32
    (`scale_in_fp32`, Gemma-4's); without, cast only (Gemma-4's value and router norms). The
    torch chains (layers.RMSNorm, layers.rms_normalize) launch 3-4 kernels each."""
    H = x.shape[-1]
    rows = x.reshape(-1, H).contiguous()
    _dtype_code(rows, "x")
    _check_rows(rows, tuple(rows.shape), x.dtype, "x")
    if weight is not None:
        _check_rows(weight, (H,), x.dtype, "weight")
    if H > MAX_NORM_HIDDEN:
        raise ValueError(f"rms_norm takes rows of up to {MAX_NORM_HIDDEN} elements, got {H}")
    out = torch.empty_like(rows)
    if rows.shape[0]:
        scale = 2 if weight is None else (1 if scale_in_fp32 else 0)
        vpt, threads = _norm_shape(H)
        _launch(f"add_rms_norm<{_DT[x.dtype]}, 0, {vpt}, {scale}>", (rows.shape[0],), threads,
                (rows, None, None, None, _i64(0), weight, None, out, H, float(eps)))
    return out.view(x.shape)


def _norm_shape(hidden: int) -> tuple[int, int]:
    """(elements per thread, threads) of add_rms_norm for a row of `hidden` elements."""
    if hidden <= 8 * THREADS:
        return 8, THREADS
    if hidden <= 16 * THREADS:
        return 16, THREADS
    return 16, -(-hidden // (16 * 32)) * 32  # up to 1024 threads


def route_topk(logits: torch.Tensor, k: int, renorm: bool, out_dtype: torch.dtype):
    """Router logits [T, E] (rows may be strided, columns contiguous) -> expert ids [T, k]
    int64 and weights [T, k] in out_dtype: softmax in fp32, the k largest in descending
    order (ties: the lower id), divided by their sum when `renorm`."""
    T, E = logits.shape
    code = _dtype_code(logits, "logits")
    if out_dtype not in _DT:
        raise ValueError(f"weights must be float32, bfloat16 or float16, got {out_dtype}")
    if not 0 < k <= min(E, MAX_TOP_K) or E > MAX_ROUTE_EXPERTS or logits.stride(1) != 1 or not logits.is_cuda:
        raise ValueError(f"route_topk takes CUDA logits [T, E <= {MAX_ROUTE_EXPERTS}] with contiguous columns "
                         f"and 0 < k <= min(E, {MAX_TOP_K}); got E={E}, k={k}, strides {logits.stride()}")
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=out_dtype, device=logits.device)
    if T:
        _launch(f"route_topk<{code}, {_DT[out_dtype]}>", (-(-T // ROUTE_WARPS),), 32 * ROUTE_WARPS,
                (logits, _i64(logits.stride(0)), T, E, k, int(renorm), ids, weights),
                shared=ROUTE_WARPS * E * 4)
    return ids, weights


def route_supported(num_experts: int, top_k: int) -> bool:
    return 0 < top_k <= min(num_experts, MAX_TOP_K) and num_experts <= MAX_ROUTE_EXPERTS


def gated_rows(gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gu [T, 2I] (gate columns first; rows may be strided) -> act(gate) * up [T, I]."""
    T, two_i = gu.shape
    code = _dtype_code(gu, "gu")
    if activation not in _ACT:
        raise ValueError(f"activation {activation!r} is not one of {tuple(_ACT)}")
    if two_i % 2 or gu.stride(1) != 1 or not gu.is_cuda:
        raise ValueError(f"gu must be CUDA [T, 2I] with contiguous columns, got {tuple(gu.shape)} {gu.stride()}")
    I = two_i // 2
    h = torch.empty(T, I, dtype=gu.dtype, device=gu.device)
    if T * I:
        _launch(f"gated_rows<{code}, {_ACT[activation]}>", (-(-T * I // THREADS),), THREADS,
                (gu, _i64(gu.stride(0)), T, I, h))
    return h


def group_supported(num_assign: int, num_experts: int, row_bytes: int) -> bool:
    return 0 < num_assign <= MAX_GROUP_ASSIGN and num_experts <= MAX_ROUTE_EXPERTS and row_bytes % 4 == 0


def group_rows(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """x [T, H], topk_ids [T, k] -> rows [T k, H] (x's rows sorted by expert, stably, as
    torch.sort orders the flat ids), inv [T k] int32 (assignment -> its row), offs [E]
    int32 (each group's end: torch._grouped_mm's offs)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    n = T * k
    _check_rows(x, (T, H), x.dtype, "x")
    _check_rows(topk_ids, (T, k), torch.int64, "topk_ids")
    if not group_supported(n, num_experts, H * x.element_size()):
        raise ValueError(f"group_rows takes 1..{MAX_GROUP_ASSIGN} assignments, <= {MAX_ROUTE_EXPERTS} experts "
                         f"and rows of whole 4-byte words; got {n}, {num_experts}, {H * x.element_size()} bytes")
    rows = torch.empty(n, H, dtype=x.dtype, device=x.device)
    inv = torch.empty(n, dtype=torch.int32, device=x.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    _launch("group_rows", (min(n, GROUP_BLOCKS),), THREADS,
            (topk_ids, n, k, num_experts, x, H * x.element_size() // 4, rows, inv, offs),
            shared=(n + 2 * num_experts) * 4)
    return rows, inv, offs


def combine_rows(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T k, H] (rows by expert), inv [T k], weights [T, k] -> [T, H]: sum over k of
    weight * y[inv] as the torch chain computes it: weights in y's dtype round each product to
    it; fp32 weights keep the products and their sum in fp32, rounded once."""
    T, k = weights.shape
    H = y.shape[1]
    code = _dtype_code(y, "y")
    _check_rows(y, (T * k, H), y.dtype, "y")
    _check_rows(inv, (T * k,), torch.int32, "inv")
    _check_rows(weights, (T, k), _weights_dtype(weights, y.dtype), "weights")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T:
        _launch(f"combine_rows<{code}, {_DT[weights.dtype]}>", (-(-T * H // THREADS),), THREADS,
                (y, inv, weights, T, k, H, out))
    return out


def _weights_dtype(weights: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The routing weights' dtype the combines take: fp32 (Gemma-4's router) or the activations'."""
    return torch.float32 if weights.dtype == torch.float32 else dtype


def grouped_moe_fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu") -> torch.Tensor | None:
    """moe_reference.grouped_moe_forward in 5 launches (group, 2 grouped products, gated,
    combine) where the torch chain takes about 13; None where group_rows does not take the
    sizes (many tokens: the caller runs the torch chain)."""
    T, H = x.shape
    E = gate_up.shape[0]
    if not group_supported(T * topk_ids.shape[1], E, H * x.element_size()):
        return None
    rows, inv, offs = group_rows(x.contiguous(), topk_ids.contiguous(), E)
    gu = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(gated_rows(gu, activation), down.transpose(1, 2), offs=offs)
    return combine_rows(y, inv, topk_weights.contiguous())


def gemv_supported(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> bool:
    """Where `experts_gemv` takes a step: at most GEMV_MAX_TOKENS_PER_EXPERT assignments per
    expert on average (the measured crossover with the grouped product) and MAX_GEMV_ASSIGN
    in all, a float dtype."""
    return 0 < num_tokens <= gemv_max_tokens(top_k, num_experts) and dtype in _DT


def gemv_max_tokens(top_k: int, num_experts: int) -> int:
    """The most tokens a step may have to take the GEMV (gemv_supported)."""
    return min(int(GEMV_MAX_TOKENS_PER_EXPERT * num_experts), MAX_GEMV_ASSIGN) // top_k


def _vectors_fit(dtype: torch.dtype, *tensors_and_strides) -> bool:
    """16-byte vectors apply: every pointer 16-byte aligned and every row length / stride a
    whole number of vectors (else the kernels read one element per lane: odd shapes)."""
    per = 4 if dtype == torch.float32 else 8
    for item in tensors_and_strides:
        if isinstance(item, torch.Tensor):
            if item.data_ptr() % 16:
                return False
        elif item % per:
            return False
    return True


def _check_experts(topk_ids: torch.Tensor, T: int, weight: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype != torch.int64 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int64 [{T}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    n = topk_ids.numel()
    if not 0 < n <= MAX_GEMV_ASSIGN:
        raise ValueError(f"the expert GEMV takes 1..{MAX_GEMV_ASSIGN} assignments, got {n}")
    if weight.dtype != dtype or weight.dim() != 3 or not weight.is_contiguous() or not weight.is_cuda:
        raise ValueError(f"{what} must be contiguous CUDA {dtype} [E, rows, cols], got {weight.dtype} "
                         f"{tuple(weight.shape)}")


def expert_gate_up(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, activation: str = "silu",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (rows may be strided), topk_ids [T, k], gate_up [E, 2I, H] (gate rows first)
    -> h [T k, I]: act(x gate_e^T) * (x up_e^T) for assignment t k + j of expert e =
    topk_ids[t, j], rounded as the grouped product and gated_rows round. `out`: where to write."""
    T, H = x.shape
    code = _dtype_code(x, "x")
    if activation not in _ACT:
        raise ValueError(f"activation {activation!r} is not one of {tuple(_ACT)}")
    if x.stride(1) != 1 or not x.is_cuda:
        raise ValueError(f"x must be CUDA [T, H] with contiguous columns, got {tuple(x.shape)} {x.stride()}")
    _check_experts(topk_ids, T, gate_up, x.dtype, "gate_up")
    E, two_i, h_cols = gate_up.shape
    if two_i % 2 or h_cols != H:
        raise ValueError(f"gate_up must be [E, 2I, {H}], got {tuple(gate_up.shape)}")
    I, n, k = two_i // 2, topk_ids.numel(), topk_ids.shape[1]
    h = torch.empty(n, I, dtype=x.dtype, device=x.device) if out is None else out
    _check_rows(h, (n, I), x.dtype, "out")
    rows = max(1, (GEMV_THREADS // 32) // k)  # gate/up pairs per tile: every warp busy at one token
    vec = "true" if _vectors_fit(x.dtype, x, gate_up, H, x.stride(0)) else "false"
    _launch(f"expert_gate_up<{code}, {_ACT[activation]}, {GEMV_ROWS}, {GEMV_UNROLL['gate_up']}, {vec}>",
            (_persistent_grid(-(-I // rows), x.device),), GEMV_THREADS,
            (x, _i64(x.stride(0)), topk_ids, n, k, gate_up, I, H, rows, h))
    return h


def expert_down_combine(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, down: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """h [T k, I] (expert_gate_up's), topk_ids, topk_weights [T, k], down [E, H, I] -> [T, H]:
    sum over k of weight * (h down_e^T), each product rounded, summed in slot order (the
    combine_rows chain). `out`: where to write."""
    n, I = h.shape
    code = _dtype_code(h, "h")
    _check_rows(h, (n, I), h.dtype, "h")
    T, k = topk_weights.shape
    _check_experts(topk_ids, T, down, h.dtype, "down")
    if topk_ids.shape[1] != k or T * k != n:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T, k] with T k = {n} rows of h")
    _check_rows(topk_weights, (T, k), _weights_dtype(topk_weights, h.dtype), "topk_weights")
    E, H, i_cols = down.shape
    if i_cols != I:
        raise ValueError(f"down must be [E, H, {I}], got {tuple(down.shape)}")
    result = torch.empty(T, H, dtype=h.dtype, device=h.device) if out is None else out
    _check_rows(result, (T, H), h.dtype, "out")
    # rows per tile, even (an item is two rows): every warp busy at one token (k experts x rows / 2 items)
    rows = min(MAX_GEMV_ROWS_PER_CTA, max(2, 2 * (GEMV_THREADS // 32) // k)) & ~1
    vec = "true" if _vectors_fit(h.dtype, h, down, I) else "false"
    _launch(f"expert_down_combine<{code}, {GEMV_ROWS}, {GEMV_UNROLL['down']}, {vec}, {_DT[topk_weights.dtype]}>",
            (_persistent_grid(-(-H // rows), h.device),), GEMV_THREADS,
            (h, topk_ids, topk_weights, n, k, down, H, I, rows, result))
    return result


def _persistent_grid(tiles: int, device: torch.device) -> int:
    """CTAs of a persistent launch over `tiles`: one wave at most (every CTA groups once)."""
    return max(1, min(tiles, GEMV_CTAS_PER_SM * sm_count(device.index)))


def experts_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """moe_reference.grouped_moe_forward (the same roundings) in two launches for few tokens
    (gemv_supported): each expert's weight rows read once per pass of up to GEMV_ROWS of its
    tokens."""
    ids = topk_ids.contiguous()
    h = expert_gate_up(x, ids, gate_up, activation)
    return expert_down_combine(h, ids, topk_weights.contiguous(), down)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, kv_heads: int,
               head_dim: int, cache: torch.Tensor, k_start: torch.Tensor, v_start: torch.Tensor) -> torch.Tensor:
    """qkv [T, (N + 2 G) D] (rows may be strided), cos, signed_sin [T, D] -> q [T, N, D]
    rotated; token t's rotated k and its v land in `cache` (the flat storage) as G D
    contiguous elements from k_start[t] and v_start[t] (int64 [T], PagedKVCache.token_elements)."""
    T = qkv.shape[0]
    N, G, D = heads, kv_heads, head_dim
    code = _dtype_code(qkv, "qkv")
    if qkv.shape[1] != (N + 2 * G) * D or qkv.stride(1) != 1 or D % 2 or not qkv.is_cuda:
        raise ValueError(f"qkv must be CUDA [T, {(N + 2 * G) * D}] with contiguous columns, even D; got "
                         f"{tuple(qkv.shape)} {qkv.stride()}, D={D}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        _check_rows(t, (T, D), qkv.dtype, name)
    for name, t in (("k_start", k_start), ("v_start", v_start)):
        if tuple(t.shape) != (T,) or t.dtype != torch.int64 or t.stride(0) != 1:
            raise ValueError(f"{name} must be int64 [{T}] with unit stride, got {t.dtype} {tuple(t.shape)}")
    if cache.dtype != qkv.dtype or cache.dim() != 1 or not cache.is_contiguous():
        raise ValueError(f"cache must be the flat {qkv.dtype} storage, got {cache.dtype} {tuple(cache.shape)}")
    q = torch.empty(T, N, D, dtype=qkv.dtype, device=qkv.device)
    width = (N + 2 * G) * D
    if T:
        _launch(f"rope_write<{code}>", (-(-width // THREADS), T), THREADS,
                (qkv, _i64(qkv.stride(0)), cos, signed_sin, N, G, D, q, cache, k_start, v_start))
    return q


def _i64(v: int):
    import numpy as np

    return np.int64(v)
