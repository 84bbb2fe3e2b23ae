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
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedweight.planner.artifact import PagedPlannerInputs
from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.policies import PlanContext
from pagedweight.planner.residual_predictor import routing_features
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
    predicted = inputs.heads.predict(routing_features(counts))
    by_key = dict(zip(inputs.head_block_keys, predicted))
    return np.array([by_key[b.key()] for b in inputs.table.block_ids], dtype=np.float64)
