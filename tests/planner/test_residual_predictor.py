"""The planner's numpy heads predict what the offline torch heads predict, from the stored file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedweight.offline.residual_heads import ResidualHeads, fit_residual_heads
from pagedweight.offline.residual_heads import routing_features as torch_features
from pagedweight.planner.residual_predictor import ResidualPredictor, routing_features


def test_numpy_heads_match_the_offline_heads_through_the_stored_file(tmp_path):
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 20, (60, 2, 4), generator=g).double()  # 60 chunks, 2 layers, 4 experts
    x = torch_features(counts)
    y = x @ torch.randn(5, 8, generator=g, dtype=torch.float64).T + 0.05 * torch.randn(60, 5, generator=g,
                                                                                       dtype=torch.float64)
    heads, _ = fit_residual_heads(x, y, ["a" if i % 2 else "b" for i in range(60)])
    path = tmp_path / "heads.safetensors"
    save_file(heads.to_tensors(), str(path))
    predictor = ResidualPredictor.load(path)
    probe = torch.randint(0, 9, (3, 2, 4), generator=g).double()
    expected = ResidualHeads.from_tensors(heads.to_tensors()).predict(torch_features(probe)).numpy()
    got = predictor.predict(routing_features(probe.numpy()))
    assert got.shape == (3, 5)
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_routing_features_are_per_layer_fractions_and_survive_empty_layers():
    counts = np.array([[3.0, 1.0], [0.0, 0.0]])
    assert routing_features(counts).tolist() == [0.75, 0.25, 0.0, 0.0]


def test_inconsistent_head_shapes_are_refused():
    with pytest.raises(ValueError, match="inconsistent head shapes"):
        ResidualPredictor.from_arrays({"weight": np.zeros((5, 8)), "bias": np.zeros(4),
                                       "feature_mean": np.zeros(8), "feature_std": np.ones(8)})


def test_non_finite_heads_are_refused():
    """The planner reads heads without the worker's file checks (`pagedweight plan`)."""
    good = {"weight": np.zeros((4, 6)), "bias": np.zeros(4), "feature_mean": np.zeros(6), "feature_std": np.ones(6)}
    ResidualPredictor.from_arrays(good)
    for name, value in (("weight", np.nan), ("bias", np.inf), ("feature_std", 0.0)):
        bad = {k: v.copy() for k, v in good.items()}
        bad[name][0] = value
        with pytest.raises(ValueError, match="finite"):
            ResidualPredictor.from_arrays(bad)
