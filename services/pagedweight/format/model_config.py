"""Model configuration read from a Hugging Face `config.json`.

Two architectures share one decoder; they differ only in the MoE block:
- Mixtral (`MixtralForCausalLM`): top-k experts with renormalised weights, no shared
  expert, no attention bias.
- Qwen1.5-MoE (`Qwen2MoeForCausalLM`): fine-grained experts, top-k without
  renormalisation (unless `norm_topk_prob`), a shared expert scaled by a sigmoid gate,
  bias on q/k/v.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int  # H
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int  # E, routed experts per layer
    num_experts_per_tok: int  # k
    expert_intermediate_size: int  # I, per routed expert
    shared_expert_intermediate_size: int  # 0 when there is no shared expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    attention_bias: bool  # bias on q/k/v projections
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def is_qwen2_moe(self) -> bool:
        return self.architecture == "Qwen2MoeForCausalLM"

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architectures = raw.get("architectures") or [raw.get("model_type", "?")]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture {architecture!r}; "
                f"PagedWeight runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return cls._parse(raw, architecture)
        except KeyError as missing:
            raise CheckpointError(f"{source}: missing key {missing.args[0]!r}") from None

    @classmethod
    def _parse(cls, raw: dict, architecture: str) -> "ModelConfig":
        hidden = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        qwen = architecture == "Qwen2MoeForCausalLM"
        if qwen and raw.get("mlp_only_layers"):
            raise UnsupportedModelError("config.json: dense `mlp_only_layers` are not supported")
        if qwen and raw.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError("config.json: `decoder_sparse_step` != 1 is not supported")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            num_experts=raw["num_experts"] if qwen else raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            expert_intermediate_size=(
                raw["moe_intermediate_size"] if qwen else raw["intermediate_size"]
            ),
            shared_expert_intermediate_size=(
                raw.get("shared_expert_intermediate_size", 0) if qwen else 0
            ),
            norm_topk_prob=raw.get("norm_topk_prob", False) if qwen else True,
            attention_bias=raw.get("qkv_bias", True) if qwen else False,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(raw, source=str(path))


def _rope_theta(raw: dict) -> float:
    """`rope_theta` lives at top level in older configs, in `rope_parameters` in newer ones."""
    params = raw.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModelError(f"config.json: rope_type {rope_type!r} is not supported")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def read_eos_token_ids(model_dir) -> tuple[int, ...]:
    """The model's EOS ids without a tokenizer: config.json's and generation_config.json's
    `eos_token_id` (an int or a list), so a tokens-only engine never drops the model's EOS."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        values = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise CheckpointError(f"{path}: eos_token_id must be a non-negative integer or a list of them")
        ids.extend(v for v in values if v not in ids)
    return tuple(ids)
