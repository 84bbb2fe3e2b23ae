"""Prompt-residual heads: predict how a prompt changes each block's sensitivity.

For calibration chunk n and block i, the target is the block's per-chunk correction
    y[n, i] = mean over b of log(S_i^chunk(b) / S_i(b)),
where S_i^chunk uses the chunk's own (smoothed) input Hessian (sensitivity.py). The
features are the chunk's routing histogram: per layer, the fraction of the chunk's
routed token slots each expert received, [L * E] values
(planner.residual_predictor.routing_features). One ridge regression per block, all
solved at once (they share the features): standardised features, closed form
    W = (X^T X + lambda I)^-1 X^T (Y - mean Y).
The fit returns the planner's own `ResidualPredictor`, which multiplies S_i(b) by
exp(prediction) for the prompts being served: one model of the heads, fitted here and
evaluated there.

Evidence: every 5th chunk of each domain is held out; R^2 per domain is measured on
those chunks against the intercept-only predictor (the training mean of each block),
i.e. R^2 = 1 - SSE(heads) / SSE(mean). The heads stored in the artifact are refit on
every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedweight.planner.residual_predictor import ResidualPredictor

RIDGE_LAMBDAS = (0.1, 1.0, 10.0, 100.0, 1000.0)


@dataclass(frozen=True)
class ResidualConfig:
    holdout_every: int = 5  # every n-th chunk of each domain is held out for R^2


def heads_tensors(heads: ResidualPredictor) -> dict[str, torch.Tensor]:
    """The stored form (residual_heads.safetensors in the paged model directory)."""
    return {name: torch.from_numpy(array) for name, array in heads.to_arrays().items()}


def fit_ridge(x: np.ndarray, y: np.ndarray, lam: float) -> ResidualPredictor:
    """x [N, F], y [N, B] -> heads (closed form on standardised features)."""
    mean, std = x.mean(0), np.maximum(x.std(0, ddof=1), 1e-6)
    z = (x - mean) / std
    y_mean = y.mean(0)
    gram = z.T @ z + lam * np.eye(z.shape[1])
    weight = np.linalg.solve(gram, z.T @ (y - y_mean)).T  # [B, F]
    return ResidualPredictor(weight, y_mean, mean, std, lam)


def r2(pred: np.ndarray, y: np.ndarray, baseline: np.ndarray) -> float:
    """1 - SSE(pred) / SSE(baseline), pooled over every (chunk, block)."""
    sse, sst = ((y - pred) ** 2).sum(), ((y - baseline) ** 2).sum()
    return float(1 - sse / max(sst, 1e-30))


def holdout_mask(domains: list[str], every: int) -> np.ndarray:
    seen: dict[str, int] = {}
    mask = []
    for d in domains:
        seen[d] = seen.get(d, 0) + 1
        mask.append(seen[d] % every == 0)
    return np.array(mask, dtype=bool)


def fit_residual_heads(features, targets, domains: list[str],
                       config: ResidualConfig = ResidualConfig()) -> tuple[ResidualPredictor, dict]:
    """features [N, F], targets [N, B] (arrays or CPU tensors) -> heads fit on all chunks,
    and the held-out report."""
    x, y = np.asarray(features, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    held = holdout_mask(domains, config.holdout_every)
    train_x, train_y = x[~held], y[~held]
    # lambda: chosen on an inner split of the training chunks, never on the held-out ones
    inner = holdout_mask([d for d, h in zip(domains, held.tolist()) if not h], 4)
    scores = {lam: r2(fit_ridge(train_x[~inner], train_y[~inner], lam).predict(train_x[inner]),
                      train_y[inner], train_y[~inner].mean(0)) for lam in RIDGE_LAMBDAS}
    lam = max(scores, key=scores.get)
    heads = fit_ridge(train_x, train_y, lam)
    report = {"ridge_lambda": lam, "num_features": x.shape[1], "num_blocks": y.shape[1],
              "num_train_chunks": int((~held).sum()), "num_heldout_chunks": int(held.sum()),
              "target": "mean_b log(S_chunk(b) / S(b))", "features": "per-layer routing fraction [L*E]",
              "heldout_r2": {}, "heldout_target_std": {}}
    for d in sorted(set(domains)):
        rows = held & np.array([c == d for c in domains], dtype=bool)
        if rows.sum() == 0:
            continue
        report["heldout_r2"][d] = r2(heads.predict(x[rows]), y[rows], np.broadcast_to(heads.bias, y[rows].shape))
        report["heldout_target_std"][d] = float(y[rows].std(ddof=1))
    report["heldout_r2"]["all"] = r2(heads.predict(x[held]), y[held], np.broadcast_to(heads.bias, y[held].shape))
    return fit_ridge(x, y, lam), report
