"""What the planner learns from the prompts now running: routing statistics and residuals.

The model runs the prompt (a prefill) with a `RoutingRecorder` on every MoE block,
which counts each expert's top-k selections and sums its gate weights per layer. From
those counts:
- the routing moving average (routing_stats.py), started from the calibration run's
  mass, is fed the prompt's tokens: hot experts for this traffic stand out;
- the prompt features (per-layer routing fractions, residual_heads.routing_features)
  go through the artifact's ridge heads: the predicted log(S_prompt / S) per block.
Both land in a `PlanContext`, the policies' one input about traffic.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedweight.planner.artifact import PagedPlannerInputs
from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.policies import PlanContext
from pagedweight.planner.routing_stats import RoutingStats


STEADY_HALF_LIVES = 4  # traffic of 4 half-lives puts ~94% of the average's weight on it


def steady_traffic_tokens(config: PlannerConfig = PlannerConfig()) -> int:
    """Tokens of traffic that stand for 'a steady stream of prompts like this one'."""
    return int(STEADY_HALF_LIVES * config.routing_half_life_tokens)


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


def prompt_context(recorder: RoutingRecorder, inputs: PagedPlannerInputs,
                   config: PlannerConfig = PlannerConfig(), use_heads: bool = True,
                   traffic_tokens: int | None = None) -> PlanContext:
    """`traffic_tokens`: how many tokens of traffic routed like this prompt the moving
    average has seen (default: the prompt's own). A larger value stands for a steady
    stream of such prompts: the average then sits near the prompt's routing, not near
    the calibration prior it started from."""
    table = inputs.table
    stats = RoutingStats(table.num_layers, table.num_experts, inputs.top_k,
                         config.routing_half_life_tokens, prior_mass=table.calib_mass)
    for layer in range(table.num_layers):
        seen = int(recorder.num_tokens[layer])
        weight = (traffic_tokens / seen) if traffic_tokens and seen else 1.0
        stats.observe_counts(layer, recorder.counts[layer] * weight, recorder.mass[layer] * weight,
                             int(round(seen * weight)))
    residual = None
    if use_heads and inputs.heads is not None:
        residual = predict_residual(recorder.counts, inputs)
    return PlanContext(stats.relative_mass(), residual)


def predict_residual(counts: np.ndarray, inputs: PagedPlannerInputs) -> np.ndarray:
    """[N] predicted log(S_prompt / S) per block, in the table's block order."""
    from pagedweight.offline.residual_heads import routing_features

    features = routing_features(torch.from_numpy(counts))
    predicted = inputs.heads.predict(features).numpy()
    by_key = dict(zip(inputs.head_block_keys, predicted))
    return np.array([by_key[b.key()] for b in inputs.table.block_ids], dtype=np.float64)
