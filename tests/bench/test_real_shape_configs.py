"""The real-shape configs parse and build models of the published sizes."""

from __future__ import annotations

import pytest

from bench.real_shape_configs import PUBLISHED_PARAMS, REAL_SHAPE_CONFIGS, parameter_count, real_shape_config


@pytest.mark.parametrize("name", list(REAL_SHAPE_CONFIGS))
def test_real_shape_model_has_the_published_parameter_count(name):
    total = parameter_count(real_shape_config(name)) / 1e9
    assert total == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01), f"{name}: {total:.3f}B parameters"


def test_families_are_told_apart():
    assert real_shape_config("Qwen3-30B-A3B").qk_norm == "head"
    assert real_shape_config("OLMoE-1B-7B").qk_norm == "full"
    assert real_shape_config("Mixtral-8x7B").qk_norm == "none"
