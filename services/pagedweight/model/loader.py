"""Load a Hugging Face checkpoint directory into `MoECausalLM`.

Reads single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`)
checkpoints. The directory is untrusted input: shard names must stay inside it; the
tensor list must match the config exactly (every tensor present with its shape, none
left over) before anything is allocated; weights must be floating point and finite.
Problems raise a `CheckpointError` naming the file and key. Routed experts come in two
layouts, both read (each layer in one of them):
- per expert (the published checkpoints): `experts.{e}.gate_proj/up_proj/down_proj.weight`
  (Mixtral: `w1/w3/w2`), stacked here into the experts operator's `gate_up` [E, 2I, H]
  and `down` [E, H, I];
- fused per layer (as `transformers` 5 holds them): `experts.gate_up_proj` [E, 2I, H] with
  gate rows first, and `experts.down_proj` [E, H, I], already our layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedweight.common.errors import CheckpointError
from pagedweight.common.safe_paths import model_file
from pagedweight.format.checkpoint_headers import INDEX_FILE, checkpoint_files, shard_index
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.materialize import materialize
from pagedweight.model.transformer import MoECausalLM



class CheckpointReader:
    """Tensor lookup by checkpoint key over one or more safetensors shards.

    Shard names come from the index file, which is untrusted: each must be a plain file
    name inside the model directory (no `../`, no absolute path, no symlink out)."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._open: dict[str, object] = {}  # shard file name -> open safetensors handle
        self.shard_of = self._key_to_shard()  # key -> shard file name

    def _key_to_shard(self) -> dict[str, str]:
        # the same files, found the same way, as every command that reads headers only
        files = checkpoint_files(self.model_dir)
        weight_map = shard_index(self.model_dir)
        if weight_map is not None:
            self._check_index_matches_shards(weight_map)
            return weight_map
        return {key: files[0].name for key in self._handle(files[0].name).keys()}

    def _check_index_matches_shards(self, weight_map: dict[str, str]) -> None:
        """The index must say where every tensor of every shard is, and only there."""
        for shard in sorted(set(weight_map.values())):
            listed = {k for k, v in weight_map.items() if v == shard}
            stored = set(self._handle(shard).keys())
            if listed != stored:
                odd = sorted(listed ^ stored)[0]
                raise CheckpointError(f"{self.model_dir / shard}: {INDEX_FILE} and the shard disagree "
                                      f"about tensor {odd[:80]!r}")

    def _handle(self, shard: str):
        if shard not in self._open:
            path = model_file(self.model_dir, shard)
            if path is None:
                raise CheckpointError(f"{self.model_dir / shard}: shard is missing")
            try:
                self._open[shard] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({err})") from None
        return self._open[shard]

    def __contains__(self, key: str) -> bool:
        return key in self.shard_of

    def check_header(self, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> None:
        """Compare the checkpoint's tensor list with `expected` (key -> shape) from the
        headers alone, before anything is allocated: every key present with its shape
        and a floating dtype, and no tensor the model would not use."""
        unused = sorted(set(self.shard_of) - set(expected) - _tolerated_extra(self.shard_of, config))
        if unused:
            raise CheckpointError(f"{self.model_dir}: {len(unused)} tensors in the checkpoint are not "
                                  f"used by the model its config.json describes (first: {unused[0][:80]!r}); "
                                  f"config and checkpoint disagree")
        for key, shape in expected.items():
            shard = self.shard_of.get(key)
            if shard is None:
                raise CheckpointError(f"{self.model_dir}: tensor {key!r} is missing from the checkpoint")
            info = self._handle(shard).get_slice(key)
            if tuple(info.get_shape()) != tuple(shape):
                raise CheckpointError(
                    f"{self.model_dir / shard}: tensor {key!r} has shape {tuple(info.get_shape())}, "
                    f"expected {tuple(shape)}")
            if info.get_dtype() not in FLOAT_DTYPES:
                raise CheckpointError(f"{self.model_dir / shard}: tensor {key!r} is {info.get_dtype()}; "
                                      f"weights must be floating point ({', '.join(FLOAT_DTYPES)})")

    def get(self, key: str, shape: tuple[int, ...] | None = None, check_finite: bool = True) -> torch.Tensor:
        """The tensor, checked for shape and floating dtype and, unless the caller checks it
        itself after moving it (check_finite=False: offline/checkpoint_layers.py does on the
        device), for NaN and infinite values."""
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
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{self.model_dir / shard}: tensor {key!r} is {tensor.dtype}, "
                                  f"weights must be floating point")
        if check_finite and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{self.model_dir / shard}: tensor {key!r} holds NaN or infinite values")
        return tensor


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors header names


def _tolerated_extra(keys, config: ModelConfig) -> set[str]:
    """Tensors some exporters write that carry nothing the model needs: rotary
    frequencies (recomputed from rope_theta), and a tied model's copy of its embedding."""
    extra = {k for k in keys if k.endswith(".rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" in keys:
        extra.add("lm_head.weight")
    if config.is_qwen2_moe and not config.shared_expert_intermediate_size:
        # transformers keeps a zero-width shared expert (and its gate), whose output is 0
        extra |= {k for k in keys if ".mlp.shared_expert." in k or ".mlp.shared_expert_gate." in k}
    return extra


def moe_prefix(config: ModelConfig, layer: int) -> str:
    """Checkpoint key prefix of one layer's MoE block: 'model.layers.N.mlp.' (Mixtral:
    '.block_sparse_moe.'); Gemma-4's router and experts sit in the layer itself."""
    name = config.moe_checkpoint_name
    return f"model.layers.{layer}." + (f"{name}." if name else "")


def expert_keys(config: ModelConfig, layer: int, expert: int) -> dict[str, str]:
    """Checkpoint keys of one routed expert: {'gate', 'up', 'down'} -> key."""
    if config.moe_checkpoint_name != "block_sparse_moe":
        prefix = f"{moe_prefix(config, layer)}experts.{expert}"
        return {p: f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down")}
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return {"gate": f"{prefix}.w1.weight", "up": f"{prefix}.w3.weight", "down": f"{prefix}.w2.weight"}


def checkpoint_key(config: ModelConfig, name: str) -> str:
    """Our parameter name -> the checkpoint key (for every non-routed-expert parameter)."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if config.tie_word_embeddings else name
    moe = config.moe_checkpoint_name
    return "model." + name.replace(".moe.", f".{moe}." if moe else ".")


def fused_expert_keys(config: ModelConfig, layer: int) -> dict[str, str]:
    """Checkpoint keys of one layer's experts in the fused layout: {'gate_up', 'down'} -> key."""
    prefix = f"{moe_prefix(config, layer)}experts"
    return {"gate_up": f"{prefix}.gate_up_proj", "down": f"{prefix}.down_proj"}


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
            return  # stored per expert in the checkpoint: load_experts below
        param.copy_(reader.get(checkpoint_key(config, name), tuple(param.shape)).to(dtype))

    # the headers first: a config that disagrees with its tensors (or asks for far more than
    # the files hold) fails before anything is allocated
    model = materialize(config, fill, dtype, device,
                        check=lambda shapes: reader.check_header(
                            config, expected_shapes(config, shapes, fused_layers(reader, config))))
    with torch.no_grad():
        for layer_idx, block in enumerate(model.moe_blocks):
            load_experts(reader, config, layer_idx, block.experts, dtype)
    return model


def fused_layers(reader: CheckpointReader, config: ModelConfig) -> frozenset[int]:
    """The layers whose experts the checkpoint stores fused."""
    return frozenset(l for l in range(config.num_layers) if fused_expert_keys(config, l)["gate_up"] in reader)


def expected_shapes(config: ModelConfig, param_shapes: dict[str, tuple[int, ...]],
                    fused_layers: frozenset[int] = frozenset()) -> dict[str, tuple[int, ...]]:
    """checkpoint key -> shape of every tensor the model reads, from its parameter shapes
    (experts per expert, except in `fused_layers`)."""
    H, I, E = config.hidden_size, config.expert_intermediate_size, config.num_experts
    shapes = {}
    for name, shape in param_shapes.items():
        if not (name.endswith("experts.gate_up") or name.endswith("experts.down")):
            shapes[checkpoint_key(config, name)] = shape
    for layer in range(config.num_layers):
        if layer in fused_layers:
            keys = fused_expert_keys(config, layer)
            shapes.update({keys["gate_up"]: (E, 2 * I, H), keys["down"]: (E, H, I)})
            continue
        for e in range(config.num_experts):
            keys = expert_keys(config, layer, e)
            shapes.update({keys["gate"]: (I, H), keys["up"]: (I, H), keys["down"]: (H, I)})
    return shapes


def load_experts(reader: CheckpointReader, config: ModelConfig, layer: int, experts, dtype,
                 check_finite: bool = True):
    H, I, E = config.hidden_size, config.expert_intermediate_size, config.num_experts
    fused = fused_expert_keys(config, layer)
    get = lambda key, shape: reader.get(key, shape, check_finite)  # noqa: E731
    if fused["gate_up"] in reader:
        experts.gate_up.copy_(get(fused["gate_up"], (E, 2 * I, H)).to(dtype))
        experts.down.copy_(get(fused["down"], (E, H, I)).to(dtype))
        return
    for e in range(E):
        keys = expert_keys(config, layer, e)
        gate = get(keys["gate"], (I, H))
        up = get(keys["up"], (I, H))
        experts.gate_up[e].copy_(torch.cat([gate, up], dim=0).to(dtype))
        experts.down[e].copy_(get(keys["down"], (H, I)).to(dtype))
