"""Gemma-4 MoE configs: what is read (per-layer shapes, windows, RoPE, both ways a config
states the full layers' shape), what is refused (naming the field), and the shared tiny
checkpoint against `transformers`. Parity and decoding of the tiny family are in
test_family_parity.py (gemma4_moe), the offline pipeline in tests/offline/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedweight.common.errors import CheckpointError, UnsupportedModelError
from pagedweight.format.model_config import ModelConfig
from tests.model.families import config_dict

SHARED_TINY = Path("/work/shared/models-pending/tiny-gemma4-moe")


def test_layer_shapes_windows_and_rope_per_layer_type():
    c = ModelConfig.from_dict(config_dict("gemma4_moe"))
    sliding, full = c.attention(0), c.attention(1)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window, sliding.k_eq_v) == (2, 16, 6, False)
    assert (full.num_kv_heads, full.head_dim, full.window, full.k_eq_v) == (1, 24, None, True)
    # default RoPE rotates every pair; proportional RoPE int(0.25 * 24 // 2) = 3 of 12
    assert (sliding.rope_theta, sliding.rope_pairs) == (10_000.0, 8)
    assert (full.rope_theta, full.rope_pairs) == (1_000_000.0, 3)
    assert [c.layer_window(i) for i in range(4)] == [6, None, 6, None]
    assert c.kv_window is None  # full layers read every token: no block falls out of all windows
    assert c.kv_slot == (2, 16)  # the widest layer's K/V elements per token
    assert (c.expert_activation, c.dense_intermediate_size, c.final_logit_softcapping) == ("gelu_tanh", 96, 30.0)
    assert (c.num_experts, c.num_experts_per_tok, c.expert_intermediate_size) == (8, 2, 32)
    assert c.attention_scale == 1.0 and c.v_norm and c.qk_norm == "head" and c.tie_word_embeddings


def test_original_config_form_reads_like_the_saved_one():
    """A config as first published (global_head_dim, num_global_key_value_heads) and as
    transformers 5.24 saves it (per_layer_config) describe the same model."""
    saved = config_dict("gemma4_moe")
    original = {k: v for k, v in saved.items() if k != "per_layer_config"}
    original.update(global_head_dim=24, num_global_key_value_heads=1)
    assert ModelConfig.from_dict(original) == ModelConfig.from_dict(saved)
    # without attention_k_eq_v, transformers keeps the KV heads of full layers global
    original["attention_k_eq_v"] = False
    full = ModelConfig.from_dict(original).attention(1)
    assert (full.num_kv_heads, full.head_dim, full.k_eq_v) == (2, 24, False)


def test_default_layer_pattern_and_last_layer_forced_full():
    raw = config_dict("gemma4_moe")
    raw.update(num_hidden_layers=7, layer_types=None, per_layer_config={})
    c = ModelConfig.from_dict(raw)
    assert [c.layer_window(i) for i in range(7)] == [6, 6, 6, 6, 6, None, None]
    raw.update(num_hidden_layers=2, layer_types=["sliding_attention", "sliding_attention"])
    assert [ModelConfig.from_dict(raw).layer_window(i) for i in range(2)] == [6, None]


@pytest.mark.parametrize("field, value", [
    ("enable_moe_block", False),
    ("hidden_activation", "gelu"),
    ("hidden_size_per_layer_input", 256),
    ("num_kv_shared_layers", 2),
    ("use_bidirectional_attention", "all"),
])
def test_unsupported_switches_are_refused_naming_the_field(field, value):
    raw = config_dict("gemma4_moe")
    ModelConfig.from_dict(raw)  # the unmodified config parses
    raw[field] = value
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("change, field", [
    (lambda r: r["rope_parameters"]["full_attention"].update(rope_type="yarn"), "rope_type"),
    (lambda r: r["rope_parameters"]["full_attention"].update(factor=8.0), "factor"),
    (lambda r: r["rope_parameters"]["sliding_attention"].update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda r: r["per_layer_config"]["1"].update(intermediate_size=64), "intermediate_size"),
    (lambda r: r["layer_types"].__setitem__(0, "chunked_attention"), "layer_types"),
])
def test_unsupported_rope_and_layer_settings_are_refused(change, field):
    raw = config_dict("gemma4_moe")
    change(raw)
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(layer_types=["full_attention"]), "layer_types must be a list of 4"),
    (lambda r: r.update(per_layer_config={"9": {"head_dim": 8}}), "per_layer_config"),
    (lambda r: r["per_layer_config"]["1"].update(head_dim=0), "head_dim must be in"),
    (lambda r: r["per_layer_config"]["1"].update(num_key_value_heads=3), "not a multiple of layer 1's 3"),
    (lambda r: r.update(top_k_experts=9), "num_experts_per_tok 9 is more than"),
    (lambda r: r.pop("moe_intermediate_size"), "moe_intermediate_size"),
])
def test_malformed_configs_are_checkpoint_errors(change, message):
    raw = config_dict("gemma4_moe")
    change(raw)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.skipif(not SHARED_TINY.is_dir(), reason="the shared tiny Gemma-4 checkpoint is not here")
@torch.inference_mode()
def test_shared_tiny_checkpoint_matches_transformers():
    import transformers

    from pagedweight.model import load_model

    ours = load_model(SHARED_TINY, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(SHARED_TINY, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    expected = reference(ids).logits  # 150 tokens: past the 128-token window of its sliding layers
    diff = (ours(ids) - expected).abs().max().item()
    assert diff < 1e-4, f"max-abs logit difference {diff}"
