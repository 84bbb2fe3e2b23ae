"""Ridge residual heads: they recover a linear signal, report held-out R^2 honestly, and
match the closed form computed here in plain numpy."""

import numpy as np
import torch

from pagedweight.offline.residual_heads import (
    ResidualConfig, fit_residual_heads, fit_ridge, heads_tensors, holdout_mask,
)
from pagedweight.planner.residual_predictor import ResidualPredictor


def synthetic(num_chunks=200, num_features=12, num_blocks=5, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(num_chunks, num_features, generator=g, dtype=torch.float64)
    true_w = torch.randn(num_blocks, num_features, generator=g, dtype=torch.float64)
    y = x @ true_w.T + 0.3 + noise * torch.randn(num_chunks, num_blocks, generator=g, dtype=torch.float64)
    domains = ["a" if i % 2 else "b" for i in range(num_chunks)]
    return x, y, domains


def test_heads_recover_a_linear_signal():
    x, y, domains = synthetic()
    heads, report = fit_residual_heads(x, y, domains)
    assert report["heldout_r2"]["all"] > 0.9 and set(report["heldout_r2"]) == {"a", "b", "all"}
    assert report["num_heldout_chunks"] == 40
    stored = {k: v.numpy() for k, v in heads_tensors(heads).items()}
    restored = ResidualPredictor.from_arrays(stored)
    assert np.allclose(restored.predict(x[:3].numpy()), heads.predict(x[:3].numpy()), atol=1e-4)
    assert np.isclose(restored.ridge_lambda, report["ridge_lambda"])  # stored as float32


def test_ridge_is_the_closed_form_on_standardised_features():
    x, y, _ = synthetic(num_chunks=40, num_features=6, num_blocks=3)
    x, y = x.numpy(), y.numpy()
    heads = fit_ridge(x, y, 10.0)
    z = (x - x.mean(0)) / x.std(0, ddof=1)
    w = np.linalg.inv(z.T @ z + 10.0 * np.eye(6)) @ z.T @ (y - y.mean(0))  # [F, B]
    assert np.allclose(heads.predict(x), z @ w + y.mean(0), atol=1e-9)


def test_pure_noise_gives_no_skill():
    x, _, domains = synthetic()
    y = torch.randn(200, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, report = fit_residual_heads(x, y, domains)
    assert report["heldout_r2"]["all"] < 0.1


def test_holdout_takes_every_nth_chunk_of_each_domain():
    mask = holdout_mask(["a", "b", "a", "a", "b", "b"], 2)
    assert mask.tolist() == [False, False, True, False, True, False]


def test_holdout_every_sets_how_many_chunks_the_report_holds_out():
    x, y, domains = synthetic()  # 100 chunks per domain
    for every, held in ((5, 40), (4, 50), (10, 20)):
        _, report = fit_residual_heads(x, y, domains, ResidualConfig(holdout_every=every))
        assert report["num_heldout_chunks"] == held and report["num_train_chunks"] == 200 - held
