"""The fused APL MoE operator: `apl_moe(x, topk_ids, topk_weights, layer)` computes one MoE layer's
routed experts straight from bit-planes and LUTs, every block at its own bit-width, on PyTorch's
current stream with no host synchronisation. `apl_moe_reference` (reference.py) is the same
function in plain torch; tests compare the two.

The package by concern:
  config.py     KernelConfig: the typed configuration and its per-shape table (config_for)
  layer.py      ResidentBlock, APLLayer: what the kernel reads of a layer
  plan.py       regime choice and grids (plan_launch, staged_plan, use_staged)
  compile.py    sources, instance names, the compile cache, precompile
  launch.py     the launches of each regime
  reference.py  apl_moe_reference
  apl_moe.cu    moe_align, moe_combine, shared helpers
  apl_gemv.cu   the decode and tiles regimes (two launches, tensor cores)
  apl_prefill.cu the prefill regime
  apl_staged.cu the staged regime (sm_90a: producer warpgroups dequantise, wgmma consumes)

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import torch

from pagedweight_kernels.compile import ACT_DTYPES, compile_stats, flag, precompile  # noqa: F401  (the API)
from pagedweight_kernels.config import DEFAULT_CONFIG, KernelConfig, config_for  # noqa: F401
from pagedweight_kernels.cuda_packages import cuda_with
from pagedweight_kernels.launch import four_launches, launch_gemv, prefill_projection, staged_projection
from pagedweight_kernels.layer import APLKernelError, APLLayer, ResidentBlock  # noqa: F401
from pagedweight_kernels.plan import plan_launch, use_staged
from pagedweight_kernels.reference import apl_moe_reference  # noqa: F401


def apl_moe(x, topk_ids, topk_weights, layer: APLLayer, out: torch.Tensor | None = None,
            regime: str | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """The MoE layer's routed-expert output [T, H] in x's dtype, from planes and LUTs.
    regime: None picks by the call's size (plan.py); "prefill" runs the prefill kernel at any
    size (a baseline, and how tests reach it with few tokens).
    config: the kernels' configuration (default: config_for the layer's shape)."""
    check_inputs(x, topk_ids, topk_weights, layer)
    T, H = x.shape
    k, E, I = topk_ids.shape[1], layer.num_experts, layer.intermediate
    config = config_for(H, I) if config is None else config
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise APLKernelError(f"out must be contiguous {x.dtype} {tuple(x.shape)} on {x.device}")
    if T == 0:
        return out
    plan = plan_launch(T, k, E, H, I, layer.max_bits, layer.stable_launches, regime, config)
    device = x.device
    with torch.cuda.device(device):
        ids = topk_ids.to(torch.int64).contiguous()
        if use_staged(plan, layer, device, T, k, regime, config):
            return four_launches(x, ids, topk_weights, layer, plan.max_active, out,
                                 staged_projection(layer, T, k, plan.max_active, flag(x.dtype), config), config=config)
        if plan.gate_up.regime in ("gemv", "tiles"):
            return launch_gemv(x, ids, topk_weights, layer, plan, out, config)
        return four_launches(x, ids, topk_weights, layer, plan.max_active, out,
                             prefill_projection(layer, plan, k, config), plan.down.splits, config)


def check_inputs(x, topk_ids, topk_weights, layer: APLLayer):
    """Everything the kernel assumes about its arguments; raises APLKernelError."""
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        raise APLKernelError(f"x must be [tokens, {layer.hidden}], got {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise APLKernelError(f"x must be bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise APLKernelError("x must be contiguous and 16-byte aligned (read as 16-byte vectors)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise APLKernelError(f"topk_ids must be [{x.shape[0]}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise APLKernelError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise APLKernelError(f"topk_weights must be floating point {tuple(topk_ids.shape)}, got "
                             f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if x.shape[0] * topk_ids.shape[1] >= 2 ** 31:
        raise APLKernelError("tokens * top_k must fit in int32")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device.type != "cuda":
            raise APLKernelError(f"{name} must be on a CUDA device, got {t.device}")
        if t.device != layer.device:
            raise APLKernelError(f"{name} is on {t.device}, the layer's blocks on {layer.device}")


def kernel_available() -> bool:
    """True where the fused kernel can run: a CUDA device and cupy."""
    return cuda_with("cupy")


__all__ = [
    "ACT_DTYPES", "APLKernelError", "APLLayer", "DEFAULT_CONFIG", "KernelConfig", "ResidentBlock", "apl_moe",
    "apl_moe_reference", "check_inputs", "compile_stats", "config_for", "kernel_available", "precompile",
]
