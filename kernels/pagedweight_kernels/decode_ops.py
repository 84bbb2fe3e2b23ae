"""Launchers of decode_ops.cu: the fused small kernels of a decode layer (issue 12).

A decode step at batch 1 is bound by the number of kernels (about 66 per layer before,
each 2-6 us over a few KB), not by bytes. Each function here replaces one chain of torch
launches with one kernel computing the same values, rounding where the chain rounds:

- `add_rms_norm`: the residual add (and Qwen's gated shared expert's add) with the next
  RMSNorm, writing both the new residual and the normalised rows (5-8 launches -> 1);
- `route_topk`: router softmax in fp32, top-k, renormalisation, the casts (4-6 -> 1);
- `gated_rows`: act(gate) * up over a [gate | up] product (2 -> 1);
- `group_rows`: the assignments sorted by expert, the groups' ends and the gathered rows
  of the grouped dense experts (6-7 -> 1); `combine_rows`: back to the tokens, weighted
  and summed over k (3 -> 1);
- `rope_write`: RoPE of q and k from the fused q/k/v product and the new k, v written to
  their places in the paged cache, any tile layout (8-20 -> 1).

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

from pagedweight_kernels.cuda_packages import cuda_with, launch_on_torch_stream, module_source

SOURCE = Path(__file__).with_name("decode_ops.cu")
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


@lru_cache(maxsize=None)
def available() -> bool:
    """True where the kernels can run: a CUDA device and cupy."""
    return cuda_with("cupy")


def _instances() -> list[str]:
    """Every kernel instance the launchers can ask for: compiled together, once."""
    dts = range(len(_DT))
    return ([f"add_rms_norm<{d}, {m}, {v}>" for d in dts for m in range(3) for v in NORM_VPT]
            + [f"route_topk<{d}, {o}>" for d in dts for o in dts]
            + [f"gated_rows<{d}, {a}>" for d in dts for a in _ACT.values()]
            + ["group_rows"] + [f"combine_rows<{d}>" for d in dts] + [f"rope_write<{d}>" for d in dts])


@lru_cache(maxsize=None)
def _module():
    """One NVRTC compile per process for all instances (a few seconds, paid by the first
    launch: a decode graph's warm-up, never its capture)."""
    import cupy as cp

    return cp.RawModule(code=module_source(SOURCE), options=("-std=c++17",), name_expressions=_instances())


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
        _launch(f"add_rms_norm<{code}, {mode}, {vpt}>", (T,), threads,
                (x, delta, shared, gate, _i64(gate.stride(0) if mode == 2 else 0), weight,
                 None if mode == 0 else residual, out, H, float(eps)))
    return residual, out


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
    weight * y[inv], each product rounded to y's dtype as the torch chain stores it."""
    T, k = weights.shape
    H = y.shape[1]
    code = _dtype_code(y, "y")
    _check_rows(y, (T * k, H), y.dtype, "y")
    _check_rows(inv, (T * k,), torch.int32, "inv")
    _check_rows(weights, (T, k), y.dtype, "weights")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T:
        _launch(f"combine_rows<{code}>", (-(-T * H // THREADS),), THREADS, (y, inv, weights, T, k, H, out))
    return out


def grouped_moe_fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu") -> torch.Tensor | None:
    """moe_reference.grouped_moe_forward in 5 launches (group, 2 grouped products, gated,
    combine) where the torch chain takes about 13; None where group_rows does not take the
    sizes (many tokens: the caller runs the torch chain)."""
    T, H = x.shape
    E = gate_up.shape[0]
    if not group_supported(T * topk_ids.shape[1], E, H * x.element_size()) or topk_weights.dtype != x.dtype:
        return None
    rows, inv, offs = group_rows(x.contiguous(), topk_ids.contiguous(), E)
    gu = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(gated_rows(gu, activation), down.transpose(1, 2), offs=offs)
    return combine_rows(y, inv, topk_weights.contiguous())


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
