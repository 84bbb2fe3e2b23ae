"""Routing statistics from the serving traffic, for the planner's damage model.

Every MoE block's observer adds the step's top-k counts and gate weights into [L, E]
tensors on the model's device (no host sync per step); when the planner is about to plan,
`flush` folds what was gathered into the planner's moving average
(services/planner/routing_stats.py) and zeroes the tensors. Folding a few steps at once
ages the average by the same number of tokens, so the result matches per-step updates
up to the order of the tokens.
"""

from __future__ import annotations

import torch

from services.planner.routing_stats import RoutingStats


class RoutingCollector:
    def __init__(self, model, stats: RoutingStats):
        self.stats = stats
        L, E = stats.num_layers, stats.num_experts
        device = model.device
        self.counts = torch.zeros(L, E, dtype=torch.float64, device=device)
        self.mass = torch.zeros(L, E, dtype=torch.float64, device=device)
        self.num_tokens = torch.zeros(L, dtype=torch.int64, device=device)
        for block in model.moe_blocks:
            block.observer = self._observe

    def _observe(self, layer: int, x, topk_ids, topk_weights) -> None:
        ids = topk_ids.reshape(-1)
        self.counts[layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
        self.mass[layer].index_add_(0, ids, topk_weights.reshape(-1).double())
        self.num_tokens[layer] += topk_ids.shape[0]

    def flush(self) -> RoutingStats:
        counts, mass, tokens = self.counts.cpu().numpy(), self.mass.cpu().numpy(), self.num_tokens.tolist()
        for layer, n in enumerate(tokens):
            self.stats.observe_counts(layer, counts[layer], mass[layer], n)
        self.counts.zero_()
        self.mass.zero_()
        self.num_tokens.zero_()
        return self.stats
