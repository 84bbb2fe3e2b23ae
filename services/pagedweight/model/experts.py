"""The experts operator: the one boundary between the model and expert weight storage.

A MoE block routes, then calls `experts(x, topk_ids, topk_weights)`; it never sees how
the expert weights are stored. `DenseExperts` (bf16/fp32 tensors) is the reference;
the paged any-precision experts and the fused CUDA kernel implement the same call.

Shape legend: T = tokens, H = hidden, E = experts, I = expert intermediate, k = top-k.
Per expert, `gate_up` stacks the gate and up projections ([2I, H], gate first) and
`down` is [H, I]; these are the two linear blocks that get paged.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight_kernels.moe_reference import check_activation, gated, moe_forward


class ExpertsOp(Protocol):
    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64 expert ids
        topk_weights: torch.Tensor,  # [T, k] routing weights, x's dtype
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

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(gated(gate, up, self.activation), self.down[e])

    def forward(self, x, topk_ids, topk_weights):
        return moe_forward(x, topk_ids, topk_weights, self.expert, self.num_experts)
