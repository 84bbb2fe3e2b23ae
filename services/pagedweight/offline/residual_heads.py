"""Prompt-residual heads: predict how a prompt changes each block's sensitivity.

For calibration chunk n and block i, the target is the block's per-chunk correction
    y[n, i] = mean over b of log(S_i^chunk(b) / S_i(b)),
where S_i^chunk uses the chunk's own (smoothed) input Hessian (sensitivity.py). The
features are the chunk's routing histogram: per layer, the fraction of the chunk's
routed token slots each expert received, [L * E] values. One ridge regression per block,
all solved at once (they share the features): standardised features, closed form
    W = (X^T X + lambda I)^-1 X^T (Y - mean Y).
The planner multiplies S_i(b) by exp(prediction) for the prompts being served.

Evidence: every 5th chunk of each domain is held out; R^2 per domain is measured on
those chunks against the intercept-only predictor (the training mean of each block),
i.e. R^2 = 1 - SSE(heads) / SSE(mean). The heads stored in the artifact are refit on
every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.planner.residual_predictor import routing_features as planner_routing_features

RIDGE_LAMBDAS = (0.1, 1.0, 10.0, 100.0, 1000.0)


@dataclass(frozen=True)
class ResidualConfig:
    holdout_every: int = 5  # every n-th chunk of each domain is held out for R^2


@dataclass
class ResidualHeads:
    """Ridge heads for B blocks over F features. Block order: paged_model.all_block_ids."""

    weight: torch.Tensor  # [B, F] on standardised features
    bias: torch.Tensor  # [B]
    feature_mean: torch.Tensor  # [F]
    feature_std: torch.Tensor  # [F]
    ridge_lambda: float

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """features [F] or [N, F] -> log corrections [B] or [N, B] of S_i(b)."""
        z = (features.double() - self.feature_mean) / self.feature_std
        return z @ self.weight.T + self.bias

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.float(), "bias": self.bias.float(),
                "feature_mean": self.feature_mean.float(), "feature_std": self.feature_std.float(),
                "ridge_lambda": torch.tensor([self.ridge_lambda])}

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> "ResidualHeads":
        return cls(named["weight"].double(), named["bias"].double(), named["feature_mean"].double(),
                   named["feature_std"].double(), float(named["ridge_lambda"][0]))


def routing_features(token_counts: torch.Tensor) -> torch.Tensor:
    """token_counts [..., L, E] routed tokens -> [..., L*E] per-layer routing fractions
    (the planner's one definition, residual_predictor.routing_features, on a tensor)."""
    return torch.from_numpy(planner_routing_features(token_counts.detach().cpu().numpy()))


def fit_ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> ResidualHeads:
    """x [N, F], y [N, B] -> heads (closed form on standardised features)."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    y_mean = y.mean(0)
    gram = z.T @ z + lam * torch.eye(z.shape[1], dtype=z.dtype)
    weight = torch.linalg.solve(gram, z.T @ (y - y_mean)).T  # [B, F]
    return ResidualHeads(weight, y_mean, mean, std, lam)


def r2(pred: torch.Tensor, y: torch.Tensor, baseline: torch.Tensor) -> float:
    """1 - SSE(pred) / SSE(baseline), pooled over every (chunk, block)."""
    sse, sst = ((y - pred) ** 2).sum(), ((y - baseline) ** 2).sum()
    return float(1 - sse / sst.clamp_min(1e-30))


def holdout_mask(domains: list[str], every: int) -> torch.Tensor:
    seen: dict[str, int] = {}
    mask = []
    for d in domains:
        seen[d] = seen.get(d, 0) + 1
        mask.append(seen[d] % every == 0)
    return torch.tensor(mask)


def fit_residual_heads(features: torch.Tensor, targets: torch.Tensor, domains: list[str],
                       config: ResidualConfig = ResidualConfig()) -> tuple[ResidualHeads, dict]:
    """features [N, F], targets [N, B] -> heads fit on all chunks, and the held-out report."""
    x, y = features.double(), targets.double()
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
        rows = held & torch.tensor([c == d for c in domains])
        if rows.sum() == 0:
            continue
        report["heldout_r2"][d] = r2(heads.predict(x[rows]), y[rows], heads.bias.expand_as(y[rows]))
        report["heldout_target_std"][d] = float(y[rows].std())
    report["heldout_r2"]["all"] = r2(heads.predict(x[held]), y[held], heads.bias.expand_as(y[held]))
    return fit_ridge(x, y, lam), report
