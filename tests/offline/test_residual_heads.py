"""Ridge residual heads: they recover a linear signal and report held-out R^2 honestly."""

import torch

from pagedweight.offline.residual_heads import (
    ResidualConfig, ResidualHeads, fit_residual_heads, holdout_mask, routing_features,
)


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
    restored = ResidualHeads.from_tensors(heads.to_tensors())
    assert torch.allclose(restored.predict(x[:3]), heads.predict(x[:3]), atol=1e-4)


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


def test_routing_features_are_per_layer_fractions():
    counts = torch.tensor([[[3.0, 1.0], [0.0, 0.0]]])  # 1 chunk, 2 layers, 2 experts
    assert routing_features(counts).tolist() == [[0.75, 0.25, 0.0, 0.0]]
