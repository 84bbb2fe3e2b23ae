"""Prompt residuals at plan time: the artifact's ridge heads evaluated with numpy.

The heads are fitted offline (pagedweight.offline.residual_heads) and stored
in the paged model directory; the planner only evaluates them, so it reads the stored
arrays with `safetensors.numpy` and stays torch-free. Features are a prompt's routing
histogram: per layer, the fraction of the routed token slots each expert received.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


def routing_features(token_counts: np.ndarray) -> np.ndarray:
    """token_counts [..., L, E] routed tokens -> [..., L*E] per-layer routing fractions.

    The one definition: the offline fit and the planner's prediction both use it."""
    counts = np.asarray(token_counts, dtype=np.float64)
    frac = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)
    return frac.reshape(*frac.shape[:-2], -1)


@dataclass
class ResidualPredictor:
    """Ridge heads for B blocks over F features (block order: the artifact's blocks)."""

    weight: np.ndarray  # [B, F] on standardised features
    bias: np.ndarray  # [B]
    feature_mean: np.ndarray  # [F]
    feature_std: np.ndarray  # [F]
    ridge_lambda: float = 0.0  # the fit's ridge penalty (a record; prediction does not use it)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """features [F] or [N, F] -> log corrections [B] or [N, B] of S_i(b)."""
        z = (np.asarray(features, dtype=np.float64) - self.feature_mean) / self.feature_std
        return z @ self.weight.T + self.bias

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The stored form: C-contiguous float32 arrays (what safetensors writes byte for byte),
        the ridge penalty as a one-element array."""
        arrays = {"weight": self.weight, "bias": self.bias, "feature_mean": self.feature_mean,
                  "feature_std": self.feature_std, "ridge_lambda": np.array([self.ridge_lambda])}
        return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in arrays.items()}

    @classmethod
    def from_arrays(cls, named: dict[str, np.ndarray]) -> "ResidualPredictor":
        """The stored form (to_arrays), read back; the file is untrusted."""
        weight = np.asarray(named["weight"], dtype=np.float64)
        bias = np.asarray(named["bias"], dtype=np.float64)
        mean = np.asarray(named["feature_mean"], dtype=np.float64)
        std = np.asarray(named["feature_std"], dtype=np.float64)
        if weight.ndim != 2 or bias.shape != weight.shape[:1] or mean.shape != std.shape != weight.shape[1:]:
            raise ValueError(f"inconsistent head shapes: weight {weight.shape}, bias {bias.shape}, "
                             f"feature mean {mean.shape}, std {std.shape}")
        if not all(np.all(np.isfinite(a)) for a in (weight, bias, mean, std)) or np.any(std <= 0):
            # the file is untrusted input: a NaN here would reach every plan the worker makes
            raise ValueError("head arrays must be finite, with feature std > 0")
        lam = np.asarray(named.get("ridge_lambda", ()), dtype=np.float64).reshape(-1)
        return cls(weight, bias, mean, std, float(lam[0]) if lam.size else 0.0)

    @classmethod
    def load(cls, path: str | Path) -> "ResidualPredictor":
        from safetensors.numpy import load_file

        return cls.from_arrays(load_file(str(path)))
