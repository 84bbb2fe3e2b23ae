"""config.json is checked for types, ranges and consistency before anything is allocated."""

from __future__ import annotations

import json
import time

import pytest

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.format.model_config import ModelConfig
from tests.conftest import BUNDLED_MODEL


def raw_config() -> dict:
    return json.loads((BUNDLED_MODEL / "config.json").read_text())


@pytest.mark.parametrize("key, value, fragment", [
    ("num_hidden_layers", 0, "num_hidden_layers must be in 1.."),
    ("num_hidden_layers", -3, "num_hidden_layers must be in 1.."),
    ("num_hidden_layers", 10**7, "num_hidden_layers must be in 1.."),
    ("hidden_size", "128", "hidden_size must be an integer"),
    ("hidden_size", 128.0, "hidden_size must be an integer"),
    ("hidden_size", True, "hidden_size must be an integer"),
    ("num_attention_heads", 0, "num_attention_heads must be in"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads"),
    ("num_experts_per_tok", 0, "num_experts_per_tok must be in"),
    ("num_experts_per_tok", 9, "more than the 8 experts"),
    ("vocab_size", 10**30, "vocab_size must be in"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be in"),
    ("rms_norm_eps", 10**400, "rms_norm_eps must be a finite number"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("eos_token_id", 99999, "eos_token_id must be token ids"),
    ("head_dim", 31, "head_dim 31 must be even"),
    ("rope_parameters", [1], "rope_parameters must be an object"),
    ("architectures", [["MixtralForCausalLM"]], "unsupported architecture"),
])
def test_bad_values_are_named(key, value, fragment):
    raw = raw_config()
    raw[key] = value
    with pytest.raises(UserError, match=fragment):  # CheckpointError, or UnsupportedModelError
        ModelConfig.from_dict(raw)


def test_hidden_size_not_divisible_by_heads_without_head_dim():
    raw = raw_config()
    raw["hidden_size"] = 130
    with pytest.raises(CheckpointError, match="not a multiple of num_attention_heads"):
        ModelConfig.from_dict(raw)


def test_ten_million_layers_fail_fast_through_the_loader(tmp_path):
    from pagedweight.model import load_model

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    raw = raw_config()
    raw["num_hidden_layers"] = 10**7
    (model_dir / "config.json").write_text(json.dumps(raw))
    (model_dir / "model.safetensors").write_bytes((BUNDLED_MODEL / "model.safetensors").read_bytes())
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load_model(model_dir)
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("data, fragment", [(b"\xff{}", "not UTF-8"), (b"[]", "expected a JSON object")])
def test_config_file_that_is_not_a_utf8_object(tmp_path, data, fragment):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(CheckpointError, match=fragment):
        ModelConfig.from_dir(tmp_path)
