import json

import pytest

from pagedweight.common.errors import CheckpointError, UnsupportedModelError
from pagedweight.format.model_config import ModelConfig
from tests.conftest import BUNDLED_MODEL


def raw_config() -> dict:
    return json.loads((BUNDLED_MODEL / "config.json").read_text())


def test_rope_theta_at_top_level_or_in_rope_parameters():
    top_level = raw_config()
    del top_level["rope_parameters"]
    top_level["rope_theta"] = 5e5
    nested = raw_config()
    del nested["rope_theta"]
    nested["rope_parameters"] = {"rope_theta": 2.5e5, "rope_type": "default"}
    assert ModelConfig.from_dict(top_level).rope_theta == 5e5
    assert ModelConfig.from_dict(nested).rope_theta == 2.5e5


def test_dense_llama_is_rejected_by_name():
    raw = raw_config()
    raw["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        ModelConfig.from_dict(raw)


def test_missing_key_is_named():
    raw = raw_config()
    del raw["num_local_experts"]
    with pytest.raises(CheckpointError, match="num_local_experts"):
        ModelConfig.from_dict(raw)


def test_mixtral_fields():
    config = ModelConfig.from_dict(raw_config())
    assert config.norm_topk_prob and not config.attention_bias
    assert config.shared_expert_intermediate_size == 0
    assert config.head_dim == config.hidden_size // config.num_heads


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    import json

    from pagedweight.common.errors import CheckpointError
    from pagedweight.format.model_config import read_eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert read_eos_token_ids(tmp_path) == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="generation_config.json"):
        read_eos_token_ids(tmp_path)
