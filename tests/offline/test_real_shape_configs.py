"""The real-shape configs parse and build models of the published sizes."""

from __future__ import annotations

import pytest

from pagedweight.offline.real_shape_configs import PUBLISHED_PARAMS, REAL_SHAPE_CONFIGS, parameter_count, real_shape_config


@pytest.mark.parametrize("name", list(REAL_SHAPE_CONFIGS))
def test_real_shape_model_has_the_published_parameter_count(name):
    total = parameter_count(real_shape_config(name)) / 1e9
    assert total == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01), f"{name}: {total:.3f}B parameters"


def test_families_are_told_apart():
    assert real_shape_config("Qwen3-30B-A3B").qk_norm == "head"
    assert real_shape_config("OLMoE-1B-7B").qk_norm == "full"
    assert real_shape_config("Mixtral-8x7B").qk_norm == "none"
    gemma = real_shape_config("Gemma-4-26B-A4B")
    assert (gemma.num_experts, gemma.num_experts_per_tok, gemma.expert_activation) == (128, 8, "gelu_tanh")
    # 25 sliding layers of 8 x 256 KV heads, 5 full ones of 2 x 512 (values = keys)
    shapes = [(a.num_kv_heads, a.head_dim, a.window, a.k_eq_v) for a in map(gemma.attention, range(30))]
    assert shapes == ([(8, 256, 1024, False)] * 5 + [(2, 512, None, True)]) * 5
    assert gemma.kv_slot == (8, 256)
