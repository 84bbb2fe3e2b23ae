"""Collects the router's live choices for the planner, as snapshots.

The planner's damage model weighs each block by its expert's routing mass, a moving
average of live traffic that the planner keeps (planner/routing_stats.py). `RoutingFeed`
is the observer every MoE block calls after routing; it adds the step's per-expert
selection counts and gate mass to [L, E] tensors on the model's device (no host sync in
the forward pass). A CUDA-graph step padded to its bucket hands the feed a 0/1 weight per row
(`set_row_weights`) so its padding rows, copies of row 0, are not counted. Just before each plan request the weight pager takes a `snapshot()`:
the window so far as a plain `RoutingSnapshot` (one device-to-host copy), and the window
starts again. The feed never touches planner state; the snapshot travels in the request.
"""

from __future__ import annotations

import torch

from pagedweight.planner.messages import RoutingSnapshot


def each_choice(rows: torch.Tensor, k: int) -> torch.Tensor:
    """[T] -> [T k]: each row's value once for each of its k routing choices, in
    topk_ids.reshape(-1)'s order (an expand: no host sync, graph-safe)."""
    return rows[:, None].expand(-1, k).reshape(-1)


class RoutingFeed:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        shape = (num_layers, num_experts)
        self.counts = torch.zeros(shape, dtype=torch.float32, device=device)  # selections this window
        self.mass = torch.zeros(shape, dtype=torch.float32, device=device)  # gate weight this window
        self.num_tokens = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.num_snapshots = 0
        self._row_weights: torch.Tensor | None = None  # [T] int 0/1 for the step being run

    def set_row_weights(self, weights: torch.Tensor | None) -> None:
        """Count row t of the next forward passes weights[t] times (0 or 1; None: every row once)."""
        self._row_weights = weights

    def __call__(self, layer: int, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The MoE block's observer: (layer, x [T, H], topk_ids [T, k], topk_weights [T, k])."""
        ids = topk_ids.reshape(-1)
        rows = self._row_weights
        if rows is None:
            self.counts[layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            self.mass[layer].index_add_(0, ids, topk_weights.detach().reshape(-1).float())
            self.num_tokens[layer] += topk_ids.shape[0]
            return
        if rows.shape[0] != topk_ids.shape[0]:
            raise RuntimeError(f"routing feed: {topk_ids.shape[0]} routed rows, {rows.shape[0]} row weights")
        per_choice = each_choice(rows.to(torch.float32), topk_ids.shape[1])
        self.counts[layer].index_add_(0, ids, per_choice)
        self.mass[layer].index_add_(0, ids, topk_weights.detach().reshape(-1).float() * per_choice)
        self.num_tokens[layer] += rows.sum()

    def install(self, model) -> None:
        for block in model.moe_blocks:
            block.observer = self

    def snapshot(self) -> RoutingSnapshot:
        """The window since the last snapshot, and a fresh window."""
        snap = RoutingSnapshot(self.counts.cpu().double().numpy(), self.mass.cpu().double().numpy(),
                               self.num_tokens.cpu().numpy().copy())
        self.counts.zero_(), self.mass.zero_(), self.num_tokens.zero_()
        self.num_snapshots += 1
        return snap
