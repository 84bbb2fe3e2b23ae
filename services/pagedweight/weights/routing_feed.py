"""Feeds the router's live choices to the planner's routing statistics.

The planner's damage model weighs each block by its expert's routing mass, a moving
average of live traffic (services/planner/routing_stats.py). `RoutingFeed` is the
observer every MoE block calls after routing; it adds the step's per-expert selection
counts and gate mass to [L, E] tensors on the model's device (no host sync in the
forward pass). Just before each plan the weight pager calls `refresh()`: the
accumulated window goes into `RoutingStats` (one update per layer, aged by its token
count) and the planner's `PlanContext.relative_mass` is set from it.
"""

from __future__ import annotations

import torch

from pagedweight.planner.policies import PlanContext
from pagedweight.planner.routing_stats import RoutingStats


class RoutingFeed:
    def __init__(self, stats: RoutingStats, context: PlanContext, device: torch.device | str = "cpu"):
        self.stats, self.context = stats, context
        shape = (stats.num_layers, stats.num_experts)
        self.counts = torch.zeros(shape, dtype=torch.float32, device=device)  # selections this window
        self.mass = torch.zeros(shape, dtype=torch.float32, device=device)  # gate weight this window
        self.num_tokens = torch.zeros(stats.num_layers, dtype=torch.int64, device=device)
        self.num_refreshes = 0

    def __call__(self, layer: int, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The MoE block's observer: (layer, x [T, H], topk_ids [T, k], topk_weights [T, k])."""
        ids = topk_ids.reshape(-1)
        self.counts[layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.mass[layer].index_add_(0, ids, topk_weights.detach().reshape(-1).float())
        self.num_tokens[layer] += topk_ids.shape[0]

    def install(self, model) -> None:
        for block in model.moe_blocks:
            block.observer = self

    def refresh(self) -> None:
        """Move the window into the moving average and the planner's context."""
        counts, mass = self.counts.cpu().double().numpy(), self.mass.cpu().double().numpy()
        tokens = self.num_tokens.cpu().tolist()
        for layer, num_tokens in enumerate(tokens):
            self.stats.observe_counts(layer, counts[layer], mass[layer], num_tokens)
        self.counts.zero_(), self.mass.zero_(), self.num_tokens.zero_()
        self.context.relative_mass = self.stats.relative_mass()
        self.num_refreshes += 1
