"""The heads the offline fit writes are the heads the planner reads: one model, through the stored file."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedweight.offline.residual_heads import fit_residual_heads
from pagedweight.planner.residual_predictor import ResidualPredictor, routing_features


def test_stored_heads_predict_what_the_fit_predicts(tmp_path):
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 20, (60, 2, 4)).astype(np.float64)  # 60 chunks, 2 layers, 4 experts
    x = routing_features(counts)
    y = x @ rng.standard_normal((5, 8)).T + 0.05 * rng.standard_normal((60, 5))
    heads, report = fit_residual_heads(x, y, ["a" if i % 2 else "b" for i in range(60)])
    path = tmp_path / "heads.safetensors"
    save_file(heads.to_arrays(), str(path))
    predictor = ResidualPredictor.load(path)
    probe = routing_features(rng.integers(0, 9, (3, 2, 4)).astype(np.float64))
    got = predictor.predict(probe)
    assert got.shape == (3, 5)
    assert np.allclose(got, heads.predict(probe), rtol=1e-5, atol=1e-5)  # float32 storage
    assert np.isclose(predictor.ridge_lambda, report["ridge_lambda"])


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
