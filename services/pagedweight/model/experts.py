"""The experts operator: the one boundary between the model and expert weight storage.

A MoE block routes, then calls `experts(x, topk_ids, topk_weights)`; it never sees how
the expert weights are stored. `DenseExperts` (bf16/fp32 tensors) is the reference;
the paged any-precision experts and the fused CUDA kernel implement the same call.

Shape legend: T = tokens, H = hidden, E = experts, I = expert intermediate, k = top-k.
Per expert, `gate_up` stacks the gate and up projections ([2I, H], gate first) and
`down` is [H, I]; these are the two linear blocks that get paged.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight_kernels import decode_ops
from pagedweight_kernels.moe_reference import (check_activation, gated, grouped_mm_supported,
                                              grouped_moe_forward, moe_forward)


class ExpertsOp(Protocol):
    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64 expert ids
        topk_weights: torch.Tensor,  # [T, k] routing weights, x's dtype or fp32 (Gemma-4: combined in fp32)
    ) -> torch.Tensor:  # [T, H]: sum over k of weight * expert(x)
        ...


class DenseExperts(nn.Module):
    """All experts of one layer as dense tensors (the unquantized reference)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        check_activation(activation)
        self.num_experts = num_experts
        self.activation = activation  # act(gate) * up: moe_reference.ACTIVATIONS
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # The grouped path (one sort, two grouped products, no host sync) or the per-expert
        # loop of moe_forward: None picks grouped on CUDA only, so CPU results stay bit for
        # bit what they were (the dequantising reference equals them exactly); True / False
        # force one (tests, and the benchmarks' baseline).
        self.grouped: bool | None = None
        # Steps of few tokens per expert on CUDA through decode_ops.experts_gemv (two launches; the
        # grouped product's tiles waste most of their rows at one token per expert), the
        # others as before. MoECausalLM.fuse_projections turns it on with the other fused
        # kernels; it follows `grouped` (off there: the per-expert loop, the baseline).
        self.few_rows_kernel = False

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(gated(gate, up, self.activation), self.down[e])

    def uses_grouped(self, dtype: torch.dtype) -> bool:
        device = self.gate_up.device
        wanted = self.grouped if self.grouped is not None else device.type == "cuda"
        if not wanted or self.gate_up.dtype != dtype:
            return False
        # asked every decode step by every layer (graph_state): no probe tensor each time
        return _grouped_supported(device.type, dtype)

    def takes_gemv(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> bool:
        return (self.few_rows_kernel and self.grouped is not False and x.is_cuda and decode_ops.available()
                and self.gate_up.dtype == x.dtype and topk_weights.dtype in (x.dtype, torch.float32)
                and decode_ops.gemv_supported(x.shape[0], topk_ids.shape[1], self.num_experts, x.dtype))

    def forward(self, x, topk_ids, topk_weights):
        if self.takes_gemv(x, topk_ids, topk_weights):
            return decode_ops.experts_gemv(x, topk_ids, topk_weights, self.gate_up, self.down, self.activation)
        if self.uses_grouped(x.dtype):
            if x.is_cuda and decode_ops.available():  # the same chain in 5 launches (few tokens)
                out = decode_ops.grouped_moe_fused(x, topk_ids, topk_weights, self.gate_up, self.down,
                                                   self.activation)
                if out is not None:
                    return out
            return grouped_moe_forward(x, topk_ids, topk_weights, self.gate_up, self.down, self.activation)
        return moe_forward(x, topk_ids, topk_weights, self.expert, self.num_experts)

    def graph_state(self, dtype: torch.dtype):
        """For CUDA-graph replay (engine/decode_graphs.py): () when the grouped path runs (no
        host-side choice to bake in), None when the per-expert loop would (it reads routing
        counts on the host, so the step must stay eager)."""
        return () if self.uses_grouped(dtype) else None


@functools.lru_cache(maxsize=None)
def _grouped_supported(device_type: str, dtype: torch.dtype) -> bool:
    return grouped_mm_supported(torch.empty(0, dtype=dtype, device=device_type))
