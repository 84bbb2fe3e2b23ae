"""A checkpoint directory is untrusted: its paths, its config and its tensors must agree."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.common.errors import CheckpointError
from pagedweight.model import load_model
from tests.model.test_loader_errors import model_copy, shard  # noqa: F401 - fixture


def edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def edit_tensors(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("shard_name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_shard_names_must_stay_inside_the_model_directory(model_copy, tmp_path, shard_name):
    shard(model_copy)
    index = model_copy / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    (tmp_path / "outside.safetensors").write_bytes((model_copy / "model-00001-of-00002.safetensors").read_bytes())
    first = sorted(weight_map)[0]
    weight_map[first] = shard_name
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="outside the model directory|not a plain relative path") as err:
        load_model(model_copy)
    assert "bytes" not in str(err.value)  # nothing about the outside file leaks


def test_the_index_must_list_every_tensor_of_its_shards(model_copy):
    shard(model_copy)
    index = model_copy / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    del weight_map[sorted(weight_map)[0]]
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="disagree"):
        load_model(model_copy)


def test_fewer_layers_in_config_than_in_the_checkpoint(model_copy):
    edit_config(model_copy, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match="not used by the model"):
        load_model(model_copy)


def test_fewer_experts_in_config_than_in_the_checkpoint(model_copy):
    edit_config(model_copy, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(CheckpointError, match="not used by the model"):
        load_model(model_copy)


def test_more_layers_in_config_than_in_the_checkpoint_fails_before_allocating(model_copy):
    edit_config(model_copy, num_hidden_layers=1000, hidden_size=8192, num_attention_heads=64)
    with pytest.raises(CheckpointError, match="shape|missing"):
        load_model(model_copy)  # 1000 layers of hidden 8192 would be tens of GB if allocated


@pytest.mark.parametrize("num_experts_per_tok", [0, 9])
def test_experts_per_token_out_of_range(model_copy, num_experts_per_tok):
    edit_config(model_copy, num_experts_per_tok=num_experts_per_tok)
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        load_model(model_copy)


def test_integer_weights_are_refused(model_copy):
    key = "model.layers.0.self_attn.q_proj.weight"
    edit_tensors(model_copy, lambda t: t.__setitem__(key, t[key].to(torch.int32)))
    with pytest.raises(CheckpointError, match="floating point"):
        load_model(model_copy)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(model_copy, value):
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"

    def poison(t):
        t[key] = t[key].clone()
        t[key][3, 5] = value
    edit_tensors(model_copy, poison)
    with pytest.raises(CheckpointError, match=r"experts\.2\.w1\.weight.* NaN or infinite"):
        load_model(model_copy)


def test_an_unused_extra_tensor_is_refused(model_copy):
    edit_tensors(model_copy, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="model.layers.0.extra.weight"):
        load_model(model_copy)
