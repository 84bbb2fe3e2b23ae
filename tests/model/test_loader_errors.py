"""Bad checkpoints give one clear error naming the file or key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.common.errors import CheckpointError, UnsupportedModelError
from pagedweight.model import load_model
from tests.conftest import BUNDLED_MODEL


@pytest.fixture
def model_copy(tmp_path):
    target = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def shard(model_dir, num_shards: int = 2):
    """Rewrite a single-file checkpoint as `num_shards` shards plus an index."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::num_shards]}
        save_file(part, model_dir / name)
        weight_map.update({k: name for k in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_identically(model_copy):
    reference = load_model(BUNDLED_MODEL, dtype=torch.float32)
    shard(model_copy)
    sharded = load_model(model_copy, dtype=torch.float32)
    for (name, a), (_, b) in zip(reference.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_shard_is_named(model_copy):
    shard(model_copy)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(model_copy)


def test_truncated_shard_is_named(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(model_copy)


def test_wrong_shape_names_key_and_shapes(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight.*expected"):
        load_model(model_copy)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="q_proj"):
        load_model(model_copy)


def test_unsupported_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        load_model(model_copy)
