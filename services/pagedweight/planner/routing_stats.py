"""Online routing statistics: a moving average of each expert's routing mass.

The worker reports, per forward step and per MoE layer, how many tokens chose each
expert and the sum of their gate weights. The planner keeps, per (layer, expert):
- `mass`: gate weight per token (the share of the layer's routed output the expert makes);
- `share`: selections per token (how often it is chosen).
Both are moving averages over tokens: a step of n tokens moves the average by
alpha = 1 - 2^(-n / half_life), so a burst of long prefills and a trickle of decode
steps age the history at the same rate per token, whatever the step sizes.

Before any traffic the averages start from a prior: the calibration run's mass if the
artifact has one, else uniform (top_k / num_experts selections, 1 / num_experts mass
per expert when gate weights are normalised).
"""

from __future__ import annotations

import numpy as np


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 half_life_tokens: float = 2048.0, prior_mass: np.ndarray | None = None):
        if num_layers < 1 or num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"bad routing shape: {num_layers} layers, {num_experts} experts, top-{top_k}")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.half_life_tokens = half_life_tokens
        shape = (num_layers, num_experts)
        if prior_mass is None:
            self.mass = np.full(shape, 1.0 / num_experts)
        else:
            self.mass = np.asarray(prior_mass, dtype=np.float64).copy()
            if self.mass.shape != shape:
                raise ValueError(f"prior_mass must be {shape}, got {self.mass.shape}")
        self.share = np.full(shape, top_k / num_experts)
        self.num_tokens_seen = np.zeros(num_layers, dtype=np.int64)

    def observe_counts(self, layer: int, counts: np.ndarray, gate_mass: np.ndarray,
                       num_tokens: int) -> None:
        """One step of one layer: counts[e] tokens chose e, with gate weights summing to gate_mass[e]."""
        if num_tokens <= 0:
            return
        alpha = 1.0 - 0.5 ** (num_tokens / self.half_life_tokens)
        self.mass[layer] += alpha * (np.asarray(gate_mass, dtype=np.float64) / num_tokens - self.mass[layer])
        self.share[layer] += alpha * (np.asarray(counts, dtype=np.float64) / num_tokens - self.share[layer])
        self.num_tokens_seen[layer] += num_tokens

    def observe(self, layer: int, topk_ids, topk_weights) -> None:
        """One step of one layer from the router's output (topk_ids, topk_weights [T, k])."""
        ids = np.asarray(_to_numpy(topk_ids), dtype=np.int64).reshape(-1)
        weights = np.asarray(_to_numpy(topk_weights), dtype=np.float64).reshape(-1)
        num_tokens = len(ids) // self.top_k if self.top_k else 0
        counts = np.bincount(ids, minlength=self.num_experts)
        gate_mass = np.bincount(ids, weights=weights, minlength=self.num_experts)
        self.observe_counts(layer, counts, gate_mass, num_tokens)

    def relative_mass(self) -> np.ndarray:
        """[L, E]: mass over its layer's mean mass (1 = an average expert, 0 = never routed)."""
        mean = self.mass.mean(axis=1, keepdims=True)
        return self.mass / np.maximum(mean, 1e-12)


def _to_numpy(x):
    """A torch tensor (any dtype, bf16 included) or array-like -> numpy."""
    if hasattr(x, "detach"):
        x = x.detach()
        return (x.float() if x.is_floating_point() else x).cpu().numpy()
    return x
