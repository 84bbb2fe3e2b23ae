"""Model configuration read from a Hugging Face `config.json`.

Four architectures share one decoder; they differ in the MoE block and in attention:
- Mixtral (`MixtralForCausalLM`): top-k experts with renormalised weights, no shared
  expert, no attention bias.
- Qwen1.5-MoE (`Qwen2MoeForCausalLM`): fine-grained experts, top-k without
  renormalisation (unless `norm_topk_prob`), a shared expert scaled by a sigmoid gate,
  bias on q/k/v.
- Qwen3-MoE (`Qwen3MoeForCausalLM`): no shared expert, `norm_topk_prob`, an RMSNorm on
  each query and key head before RoPE (`qk_norm="head"`), optional bias on q/k/v/o.
- OLMoE (`OlmoeForCausalLM`): like Qwen3-MoE, but its q/k RMSNorms run over the whole
  projection before the heads are split (`qk_norm="full"`).
Switches these configs may carry that change the maths but that we do not implement
(Qwen3-MoE windows on only the first `max_window_layers`, `clip_qkv` on OLMoE, dense-only layers, other
activations) are refused with an error naming the field, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
# Architectures whose MoE block sits under `model.layers.N.mlp` in checkpoints (Mixtral
# uses `block_sparse_moe`).
_MLP_NAMED_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
QK_NORMS = ("none", "head", "full")


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
    # Added with Qwen3-MoE and OLMoE; the defaults are Mixtral's and Qwen1.5-MoE's.
    qk_norm: str = "none"  # one of QK_NORMS: RMSNorm on q, k per head, over the full projection, or none
    o_proj_bias: bool = False  # bias on the output projection (Qwen3-MoE/OLMoE `attention_bias`)
    # Sliding-window attention (Qwen3-MoE `use_sliding_window`): a query at position p sees
    # keys at p - sliding_window + 1 .. p, in every layer. None: full causal attention.
    sliding_window: int | None = None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer (None: full attention)."""
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer keeps within, or None if some layer attends to everything:
        KV of tokens more than kv_window - 1 behind the next query is read by no layer again."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else max(windows)

    @property
    def is_qwen2_moe(self) -> bool:
        return self.architecture == "Qwen2MoeForCausalLM"

    @property
    def moe_checkpoint_name(self) -> str:
        """The MoE block's module name in checkpoint keys."""
        return "mlp" if self.architecture in _MLP_NAMED_MOE else "block_sparse_moe"

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
        if architecture in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
            return cls._parse_qk_norm_family(raw, architecture)
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
    def _parse_qk_norm_family(cls, raw: dict, architecture: str) -> "ModelConfig":
        """Qwen3-MoE and OLMoE: q/k RMSNorms, no shared expert, one bias switch for q/k/v/o."""
        qwen3 = architecture == "Qwen3MoeForCausalLM"
        _refuse_other_activations(raw)
        if qwen3:
            if raw.get("mlp_only_layers"):
                raise UnsupportedModelError("config.json: dense `mlp_only_layers` are not supported")
            if raw.get("decoder_sparse_step", 1) != 1:
                raise UnsupportedModelError("config.json: `decoder_sparse_step` != 1 is not supported")
            if raw.get("use_sliding_window") and raw.get("max_window_layers", raw["num_hidden_layers"]) < raw["num_hidden_layers"]:
                # transformers 5.24 windows every layer; older configs' max_window_layers
                # said only the first N layers were windowed: refuse what we would misread
                raise UnsupportedModelError(
                    "config.json: `max_window_layers` below num_hidden_layers with `use_sliding_window` "
                    "is not supported")
        elif raw.get("clip_qkv") is not None:
            raise UnsupportedModelError("config.json: `clip_qkv` (clamped q/k/v) is not supported")
        hidden = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        # OLMoE has no head_dim key: its heads are hidden // num_heads, and its k_norm spans
        # num_kv_heads of them.
        head_dim = (raw.get("head_dim") if qwen3 else None) or hidden // num_heads
        bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            # transformers 5 writes `num_local_experts` (an alias) for these families
            num_experts=raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            expert_intermediate_size=raw["moe_intermediate_size"] if qwen3 else raw["intermediate_size"],
            shared_expert_intermediate_size=0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            attention_bias=bias,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6 if qwen3 else 1e-5),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            qk_norm="head" if qwen3 else "full",
            o_proj_bias=bias,
            sliding_window=_sliding_window(raw) if qwen3 else None,
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


def _sliding_window(raw: dict) -> int | None:
    if not raw.get("use_sliding_window"):
        return None
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(f"config.json: `sliding_window` must be a positive integer, got {window!r}")
    return window


def _refuse_other_activations(raw: dict) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act {act!r} is not supported (experts use SiLU)")


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
