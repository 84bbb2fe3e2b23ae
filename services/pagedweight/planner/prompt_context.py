"""What the planner learns from the prompts now running: routing statistics and residuals.

The model runs the prompt (a prefill) with a `RoutingRecorder` (offline/prompt_routing.py)
on every MoE block,
which counts each expert's top-k selections and sums its gate weights per layer. From
those counts:
- the routing moving average (routing_stats.py), started from the calibration run's
  mass, is fed the prompt's tokens: hot experts for this traffic stand out;
- the prompt features (per-layer routing fractions, residual_predictor.routing_features)
  go through the artifact's ridge heads: the predicted log(S_prompt / S) per block.
Both land in a `PlanContext`, the policies' one input about traffic.

Online (the worker), the routing moving average is fed by every step's routing anyway;
the prompts in flight reach the planner as a `PromptMix` in each `PlanRequest`, its
residual computed by `HeadsInBlockOrder` (the heads, rows in the worker's block order).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedweight.planner.artifact import PagedPlannerInputs
from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.policies import PlanContext
from pagedweight.planner.residual_predictor import ResidualPredictor, routing_features
from pagedweight.planner.routing_stats import RoutingStats


STEADY_HALF_LIVES = 4  # traffic of 4 half-lives puts ~94% of the average's weight on it


def steady_traffic_tokens(config: PlannerConfig = PlannerConfig()) -> int:
    """Tokens of traffic that stand for 'a steady stream of prompts like this one'."""
    return int(STEADY_HALF_LIVES * config.routing_half_life_tokens)


class PromptRouting(Protocol):
    """A prompt's routing, per MoE layer (offline.prompt_routing.RoutingRecorder records it)."""

    counts: np.ndarray  # [L, E] top-k selections
    mass: np.ndarray  # [L, E] gate weight
    num_tokens: np.ndarray  # [L] tokens seen


def prompt_context(recorder: PromptRouting, inputs: PagedPlannerInputs,
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
    heads = HeadsInBlockOrder(inputs.heads, inputs.head_block_keys, [b.key() for b in inputs.table.block_ids])
    return heads(counts)


class HeadsInBlockOrder:
    """The artifact's residual heads with their outputs in another block order (a worker's
    registration order): routing [L, E] (counts or fractions) -> [N] predicted log(S_prompt / S)."""

    def __init__(self, heads: ResidualPredictor, head_block_keys: list[str], block_keys: list[str],
                 num_features: int | None = None):
        """`num_features`: L * E of the model, checked against the heads' (None: not checked)."""
        row = {key: i for i, key in enumerate(head_block_keys)}
        missing = [key for key in block_keys if key not in row]
        if missing or len(head_block_keys) != len(heads.bias):
            raise ValueError(f"residual heads do not cover the blocks (first missing: "
                             f"{missing[0] if missing else None}; {len(heads.bias)} heads for "
                             f"{len(head_block_keys)} keys)")
        if num_features is not None and heads.weight.shape[1] != num_features:
            raise ValueError(f"residual heads take {heads.weight.shape[1]} features, the model's routing "
                             f"has {num_features} (layers x experts)")
        self.heads = heads
        self.rows = np.array([row[key] for key in block_keys], dtype=np.int64)

    def __call__(self, routing: np.ndarray) -> np.ndarray:
        return self.heads.predict(routing_features(routing))[self.rows]
