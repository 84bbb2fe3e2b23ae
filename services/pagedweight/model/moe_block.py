"""The sparse MoE block: router, experts operator, optional gated shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.experts import DenseExperts, ExpertsOp
from pagedweight.model.layers import GatedMLP

# Called after routing with (layer_idx, x [T, H], topk_ids [T, k], topk_weights [T, k]);
# the worker feeds routing statistics from it, calibration records expert inputs.
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts: ExpertsOp = DenseExperts(
            config.num_experts, config.hidden_size, config.expert_intermediate_size, config.expert_activation
        )
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.observer: RoutingObserver | None = None

    def route(self, x: torch.Tensor):
        """x [T, H] -> topk_ids [T, k], topk_weights [T, k] (softmax in fp32, then top-k)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights.to(x.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.route(x)
        if self.observer is not None:
            self.observer(self.layer_idx, x, topk_ids, topk_weights)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
