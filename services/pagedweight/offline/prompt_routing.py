"""Record a prompt's routing: prefill it through the model with an observer on every MoE block.

The recorder counts each expert's top-k selections and sums its gate weights per layer;
the planner turns those numbers into a plan context (planner/prompt_context.py). This
part runs the model, so it lives offline, not in the torch-free planner.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingRecorder:
    """Per-layer top-k counts and gate mass of every forward pass while attached."""

    def __init__(self, model, num_experts: int):
        self.blocks = list(model.moe_blocks)
        self.counts = np.zeros((len(self.blocks), num_experts))
        self.mass = np.zeros((len(self.blocks), num_experts))
        self.num_tokens = np.zeros(len(self.blocks), dtype=np.int64)
        for block in self.blocks:
            block.observer = self._observe

    def _observe(self, layer: int, x, topk_ids, topk_weights) -> None:
        ids = topk_ids.reshape(-1).cpu().numpy()
        weights = topk_weights.reshape(-1).float().cpu().numpy()
        self.counts[layer] += np.bincount(ids, minlength=self.counts.shape[1])
        self.mass[layer] += np.bincount(ids, weights=weights, minlength=self.counts.shape[1])
        self.num_tokens[layer] += topk_ids.shape[0]

    def detach(self) -> None:
        for block in self.blocks:
            block.observer = None


@torch.inference_mode()
def record_prompt_routing(model, token_ids: list[int], num_experts: int, window: int = 256) -> RoutingRecorder:
    """Prefill the prompt in windows of `window` tokens and record its routing."""
    recorder = RoutingRecorder(model, num_experts)
    try:
        device = next(model.parameters()).device
        for start in range(0, len(token_ids), window):
            model(torch.tensor([token_ids[start:start + window]], device=device))
    finally:
        recorder.detach()
    return recorder
