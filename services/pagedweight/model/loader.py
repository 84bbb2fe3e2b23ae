"""Load a Hugging Face checkpoint directory into `MoECausalLM`.

Reads single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`)
checkpoints. Every tensor is checked for presence and shape; problems raise a
`CheckpointError` naming the file and key. Per-expert checkpoint keys are stacked into
the experts operator's `gate_up` [E, 2I, H] and `down` [E, H, I] tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedweight.common.errors import CheckpointError
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.materialize import materialize
from pagedweight.model.transformer import MoECausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """Tensor lookup by checkpoint key over one or more safetensors shards."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._open: dict[str, object] = {}  # shard file name -> open safetensors handle
        self.shard_of = self._key_to_shard()  # key -> shard file name

    def _key_to_shard(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: malformed shard index ({err})") from None
            for shard in sorted(set(weight_map.values())):
                if not (self.model_dir / shard).is_file():
                    raise CheckpointError(f"{self.model_dir / shard}: shard listed in {INDEX_FILE} is missing")
            return weight_map
        single = self.model_dir / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        return {key: SINGLE_FILE for key in self._handle(SINGLE_FILE).keys()}

    def _handle(self, shard: str):
        if shard not in self._open:
            path = self.model_dir / shard
            try:
                self._open[shard] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({err})") from None
        return self._open[shard]

    def __contains__(self, key: str) -> bool:
        return key in self.shard_of

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shard = self.shard_of.get(key)
        if shard is None:
            raise CheckpointError(f"{self.model_dir}: tensor {key!r} is missing from the checkpoint")
        try:
            tensor = self._handle(shard).get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self.model_dir / shard}: cannot read {key!r} ({err})") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.model_dir / shard}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(shape)}"
            )
        return tensor


def expert_keys(config: ModelConfig, layer: int, expert: int) -> dict[str, str]:
    """Checkpoint keys of one routed expert: {'gate', 'up', 'down'} -> key."""
    if config.is_qwen2_moe:
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        return {p: f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down")}
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return {"gate": f"{prefix}.w1.weight", "up": f"{prefix}.w3.weight", "down": f"{prefix}.w2.weight"}


def checkpoint_key(config: ModelConfig, name: str) -> str:
    """Our parameter name -> the checkpoint key (for every non-routed-expert parameter)."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if config.tie_word_embeddings else name
    moe_name = "mlp" if config.is_qwen2_moe else "block_sparse_moe"
    return "model." + name.replace(".moe.", f".{moe_name}.")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> MoECausalLM:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory does not exist")
    config = ModelConfig.from_dir(model_dir)
    reader = CheckpointReader(model_dir)

    def fill(name: str, param: torch.Tensor) -> None:
        if name.endswith("experts.gate_up") or name.endswith("experts.down"):
            return  # stored per expert in the checkpoint: _load_experts below
        param.copy_(reader.get(checkpoint_key(config, name), tuple(param.shape)).to(dtype))

    model = materialize(config, fill, dtype, device)
    with torch.no_grad():
        for layer_idx, block in enumerate(model.moe_blocks):
            _load_experts(reader, config, layer_idx, block.experts, dtype)
    return model


def _load_experts(reader: CheckpointReader, config: ModelConfig, layer: int, experts, dtype):
    H, I = config.hidden_size, config.expert_intermediate_size
    for e in range(config.num_experts):
        keys = expert_keys(config, layer, e)
        gate = reader.get(keys["gate"], (I, H))
        up = reader.get(keys["up"], (I, H))
        experts.gate_up[e].copy_(torch.cat([gate, up], dim=0).to(dtype))
        experts.down[e].copy_(reader.get(keys["down"], (H, I)).to(dtype))
