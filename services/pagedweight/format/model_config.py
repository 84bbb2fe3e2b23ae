"""Model configuration read from a Hugging Face `config.json`.

Five architectures share one decoder; they differ in the MoE block and in attention:
- Mixtral (`MixtralForCausalLM`): top-k experts with renormalised weights, no shared
  expert, no attention bias; `sliding_window` windows every layer.
- Qwen1.5-MoE (`Qwen2MoeForCausalLM`): fine-grained experts, top-k without
  renormalisation (unless `norm_topk_prob`), a shared expert scaled by a sigmoid gate,
  bias on q/k/v; with `use_sliding_window`, the layers `layer_types` names are windowed.
- Qwen3-MoE (`Qwen3MoeForCausalLM`): no shared expert, `norm_topk_prob`, an RMSNorm on
  each query and key head before RoPE (`qk_norm="head"`), optional bias on q/k/v/o.
- OLMoE (`OlmoeForCausalLM`): like Qwen3-MoE, but its q/k RMSNorms run over the whole
  projection before the heads are split (`qk_norm="full"`), and `clip_qkv` clamps q/k/v.
- Gemma-4 MoE (`Gemma4ForCausalLM` with `enable_moe_block`): parsed in gemma4_config.py;
  per-layer attention shapes, windows and RoPE (`layer_attention`), GELU-tanh experts,
  a dense MLP beside them, q/k/v norms, embedding scale and logit softcapping.
The first four share `hidden_act` (SiLU or GELU-tanh experts) and RoPE scaling
(rope_config.py: default, linear, llama3, yarn).
Every field a config carries is either read here or listed as inert in config_fields.py;
any other is refused at load naming it. Switches that change the maths but that we do not
implement (Qwen3-MoE windows on only the first `max_window_layers`, dense-only layers,
other activations, dynamic or longrope RoPE) are refused with an error naming the field,
never silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import CheckpointError, UnsupportedModelError
from pagedweight.common.json_files import read_json_object
from pagedweight.common.safe_paths import model_file
from pagedweight.format.config_fields import refuse_unknown_fields
from pagedweight.format.rope_config import RopeScaling, parse_rope

SUPPORTED_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Gemma4ForCausalLM",
)
# Architectures whose MoE block sits under `model.layers.N.mlp` in checkpoints (Mixtral
# uses `block_sparse_moe`).
_MLP_NAMED_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
QK_NORMS = ("none", "head", "full")
# The gated experts' activation: act(gate) * up. "gelu_tanh" is GELU's tanh approximation
# (transformers' `gelu_pytorch_tanh`), Gemma-4's.
EXPERT_ACTIVATIONS = ("silu", "gelu_tanh")
# transformers' `hidden_act` names -> EXPERT_ACTIVATIONS (the same function, up to rounding:
# "gelu_new" writes GELU's tanh form out by hand)
HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention looks like where layers differ (Gemma-4: sliding and full
    layers have their own KV heads, head dim, window and RoPE)."""

    num_kv_heads: int
    head_dim: int
    window: int | None  # None: full causal attention
    rope_theta: float
    # frequency pairs that rotate: head_dim // 2, fewer with partial ("proportional") RoPE,
    # whose remaining pairs have frequency 0 (cos 1, sin 0: those dims pass through)
    rope_pairs: int
    k_eq_v: bool = False  # values are the key projection (no v_proj), before the k norm
    rope_scaling: RopeScaling = RopeScaling()  # how the frequencies are rescaled (linear, llama3, yarn)


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
    # Per layer where layers differ (Qwen1.5-MoE's `layer_types`): overrides sliding_window.
    layer_windows: tuple[int | None, ...] = ()
    rope_scaling: RopeScaling = RopeScaling()
    # OLMoE: q, k and v are clamped to [-clip_qkv, clip_qkv] (after the q/k norms). None: not clamped.
    clip_qkv: float | None = None
    # Added with Gemma-4; the defaults are the other families'.
    expert_activation: str = "silu"  # one of EXPERT_ACTIVATIONS
    layer_attention: tuple[LayerAttention, ...] = ()  # per layer; empty: every layer as `attention(0)`
    v_norm: bool = False  # a scale-free RMSNorm on each value head
    attention_scale: float | None = None  # q.k scale; None: 1 / sqrt(head_dim)
    dense_intermediate_size: int = 0  # Gemma-4's dense MLP beside the routed experts
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def is_gemma4(self) -> bool:
        return self.architecture == "Gemma4ForCausalLM"

    def attention(self, layer: int) -> LayerAttention:
        """One layer's attention shape, window and RoPE."""
        if self.layer_attention:
            return self.layer_attention[layer]
        window = self.layer_windows[layer] if self.layer_windows else self.sliding_window
        return LayerAttention(self.num_kv_heads, self.head_dim, window, self.rope_theta, self.head_dim // 2,
                              rope_scaling=self.rope_scaling)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer (None: full attention)."""
        return self.attention(layer).window

    @property
    def kv_slot(self) -> tuple[int, int]:
        """(KV heads, head dim) of one layer's slot in the paged KV cache: the widest layer's
        shape. Layers with fewer K/V elements per token (Gemma-4's full-attention layers)
        use the front of the slot; the rest stays unused (the simple first step)."""
        shapes = [(a.num_kv_heads, a.head_dim) for a in (self.attention(i) for i in range(self.num_layers))]
        return max(shapes, key=lambda s: s[0] * s[1])

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
        """The MoE block's module name in checkpoint keys ("": Gemma-4's router and experts
        sit directly in the decoder layer, whose `mlp` is the dense MLP)."""
        if self.is_gemma4:
            return ""
        return "mlp" if self.architecture in _MLP_NAMED_MOE else "block_sparse_moe"

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Parse and check a config: types, ranges and the relations between fields, so a
        config that asks for 10^7 layers or 0 experts per token fails here, before any
        memory is allocated for it."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        architectures = raw.get("architectures") or [raw.get("model_type", "?")]
        architecture = architectures[0] if isinstance(architectures, list) else architectures
        if not isinstance(architecture, str) or architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture {repr(architecture)[:80]}; "
                f"PagedWeight runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        refuse_unknown_fields(raw, architecture, source)
        config = cls._parse(_Fields(raw, source), architecture)
        config._check_relations(source)
        return config

    @classmethod
    def _parse(cls, f: "_Fields", architecture: str) -> "ModelConfig":
        if architecture in FAMILY_PARSERS:  # a family parsed in a module of its own
            return FAMILY_PARSERS[architecture](cls, f)
        if architecture in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
            return cls._parse_qk_norm_family(f, architecture)
        qwen = architecture == "Qwen2MoeForCausalLM"
        if qwen:
            _refuse_dense_layers(f)
        # transformers' attribute_map lets either name of the expert count stand
        experts_key = "num_experts" if qwen or (f.raw.get("num_local_experts") is None
                                                and f.raw.get("num_experts") is not None) else "num_local_experts"
        common = _common_fields(f, experts_key, "moe_intermediate_size" if qwen else "intermediate_size")
        # Mixtral's `sliding_window` windows every layer; Qwen1.5-MoE's the layers `layer_types` names
        windows = (_qwen2_windows(f, common["num_layers"]) if qwen
                   else (f.int("sliding_window", 1, MAX_POSITIONS, default=None),))
        rope_theta, rope_scaling = parse_rope(f, default_theta=10_000.0 if qwen else 1_000_000.0)
        return cls(
            architecture=architecture,
            **common,
            head_dim=(f.int("head_dim", 1, MAX_HEAD_DIM, default=None)
                      or _default_head_dim(f, common["hidden_size"], common["num_heads"])),
            shared_expert_intermediate_size=(
                f.int("shared_expert_intermediate_size", 0, MAX_INTERMEDIATE, default=0) if qwen else 0
            ),
            norm_topk_prob=f.bool("norm_topk_prob", False) if qwen else True,
            attention_bias=f.bool("qkv_bias", True) if qwen else False,
            rms_norm_eps=f.float("rms_norm_eps", 0.0, 1.0, default=1e-6),
            rope_theta=rope_theta,
            sliding_window=windows[0] if len(set(windows)) == 1 else None,
            layer_windows=windows if len(set(windows)) > 1 else (),
            rope_scaling=rope_scaling,
        )

    def _check_relations(self, source: str) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} is more than "
                                  f"the {self.num_experts} experts per layer")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                                  f"num_key_value_heads {self.num_kv_heads}")
        for layer in range(self.num_layers):
            shape = self.attention(layer)
            if self.num_heads % shape.num_kv_heads:
                raise CheckpointError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                                      f"layer {layer}'s {shape.num_kv_heads} key/value heads")
            if shape.head_dim % 2:
                raise CheckpointError(f"{source}: head_dim {shape.head_dim} must be even "
                                      f"(layer {layer}; rotary embedding)")

    @classmethod
    def _parse_qk_norm_family(cls, f: "_Fields", architecture: str) -> "ModelConfig":
        """Qwen3-MoE and OLMoE: q/k RMSNorms, no shared expert, one bias switch for q/k/v/o."""
        qwen3 = architecture == "Qwen3MoeForCausalLM"
        raw, source = f.raw, f.source
        if qwen3:
            _refuse_dense_layers(f)
        # transformers 5 writes `num_local_experts` (an alias) for these families
        experts_key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        common = _common_fields(f, experts_key, "moe_intermediate_size" if qwen3 else "intermediate_size")
        # OLMoE has no head_dim key: its heads are hidden // num_heads, and its k_norm spans
        # num_kv_heads of them.
        head_dim = (f.int("head_dim", 1, MAX_HEAD_DIM, default=None) if qwen3 else None) \
            or _default_head_dim(f, common["hidden_size"], common["num_heads"])
        if not qwen3 and raw.get("head_dim") not in (None, head_dim):
            # transformers' OLMoE norms q and k over hidden_size-wide projections: no other head dim runs
            raise UnsupportedModelError(f"{source}: head_dim {repr(raw.get('head_dim'))[:20]} other than "
                                        f"hidden_size / num_attention_heads ({head_dim}) is not supported")
        rope_theta, rope_scaling = parse_rope(f, default_theta=10_000.0)
        bias = f.bool("attention_bias", False)
        return cls(
            architecture=architecture,
            **common,
            head_dim=head_dim,
            shared_expert_intermediate_size=0,
            norm_topk_prob=f.bool("norm_topk_prob", False),
            attention_bias=bias,
            rms_norm_eps=f.float("rms_norm_eps", 0.0, 1.0, default=1e-6 if qwen3 else 1e-5),
            rope_theta=rope_theta,
            qk_norm="head" if qwen3 else "full",
            o_proj_bias=bias,
            sliding_window=_sliding_window(f, common["num_layers"]) if qwen3 else None,
            rope_scaling=rope_scaling,
            clip_qkv=None if qwen3 else f.float("clip_qkv", 0.0, 1e30, default=None),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = model_file(model_dir, "config.json")
        if path is None:
            raise CheckpointError(f"{Path(model_dir) / 'config.json'}: no config.json in the model directory")
        return cls.from_dict(read_json_object(path, "config.json", CheckpointError), source=str(path))


# Far above any real MoE (Mixtral-8x7B: 32 layers, hidden 4096, vocab 32000) and far below
# what would exhaust a machine's memory before the checkpoint's own tensors are compared.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_EXPERTS = 4096
MAX_INTERMEDIATE = 1 << 18
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
_MISSING = object()


def _common_fields(f: "_Fields", experts_key: str, intermediate_key: str) -> dict:
    """The fields the Mixtral, Qwen-MoE and OLMoE parsers read alike: sizes, heads, experts,
    positions, embeddings, stop tokens and the experts' activation."""
    num_heads = f.int("num_attention_heads", 1, MAX_HEADS)
    vocab = f.int("vocab_size", 1, MAX_VOCAB)
    return dict(
        vocab_size=vocab,
        hidden_size=f.int("hidden_size", 1, MAX_HIDDEN),
        num_layers=f.int("num_hidden_layers", 1, MAX_LAYERS),
        num_heads=num_heads,
        num_kv_heads=f.int("num_key_value_heads", 1, MAX_HEADS, default=num_heads),
        num_experts=f.int(experts_key, 1, MAX_EXPERTS),
        num_experts_per_tok=f.int("num_experts_per_tok", 1, MAX_EXPERTS),
        expert_intermediate_size=f.int(intermediate_key, 1, MAX_INTERMEDIATE),
        max_position_embeddings=f.int("max_position_embeddings", 1, MAX_POSITIONS, default=4096),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=_eos_ids(f, vocab),
        expert_activation=_expert_activation(f),
    )


class _Fields:
    """Typed reads of a raw config dict; each error names the file and the key. A key
    that is absent or null takes its default (a required key has none)."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def _absent(self, raw: dict, key: str, default) -> bool:
        if raw.get(key) is not None:
            return False
        if default is _MISSING:
            raise CheckpointError(f"{self.source}: missing key {key!r}")
        return True

    def int(self, key: str, lo: int, hi: int, default=_MISSING):
        if self._absent(self.raw, key, default):
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.source}: {key} must be an integer, got {repr(value)[:60]}")
        if not lo <= value <= hi:
            raise CheckpointError(f"{self.source}: {key} must be in {lo}..{hi}, got {repr(value)[:60]}")
        return value

    def float(self, key: str, lo: float, hi: float, default=_MISSING, raw: dict | None = None) -> float:
        raw = self.raw if raw is None else raw
        if self._absent(raw, key, default):
            return default
        value = raw[key]
        number = _finite_float(value)
        if number is None:
            raise CheckpointError(f"{self.source}: {key} must be a finite number, got {repr(value)[:60]}")
        if not lo < number <= hi:
            raise CheckpointError(f"{self.source}: {key} must be in ({lo}, {hi}], got {number!r}")
        return number

    def bool(self, key: str, default: bool) -> bool:
        if self._absent(self.raw, key, default):
            return default
        value = self.raw[key]
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.source}: {key} must be true or false, got {repr(value)[:60]}")
        return value


def _finite_float(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # an integer past 1e308 overflows
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _default_head_dim(f: _Fields, hidden: int, num_heads: int) -> int:
    if hidden % num_heads:
        raise CheckpointError(f"{f.source}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {num_heads} (and no head_dim is given)")
    return hidden // num_heads


def _eos_ids(f: _Fields, vocab: int) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise CheckpointError(f"{f.source}: eos_token_id must be token ids in 0..{vocab - 1}, "
                                  f"got {repr(eos)[:60]}")
    return tuple(ids)


def _sliding_window(f: _Fields, num_layers: int) -> int | None:
    """Qwen3-MoE's window: with `use_sliding_window`, transformers 5.24 windows every layer."""
    if not f.bool("use_sliding_window", False):
        return None
    if f.int("max_window_layers", 0, MAX_LAYERS, default=num_layers) < num_layers:
        # older configs' max_window_layers windowed only some layers: refuse what we would misread
        raise UnsupportedModelError(
            f"{f.source}: `max_window_layers` below num_hidden_layers with `use_sliding_window` is not supported")
    return f.int("sliding_window", 1, MAX_POSITIONS)


def _refuse_dense_layers(f: _Fields) -> None:
    """Qwen's dense layers between the MoE ones: PagedWeight pages every layer's experts."""
    if f.raw.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{f.source}: dense `mlp_only_layers` are not supported")
    if f.raw.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(f"{f.source}: `decoder_sparse_step` != 1 is not supported")


def _qwen2_windows(f: _Fields, num_layers: int) -> tuple[int | None, ...]:
    """Qwen1.5-MoE's window per layer, as transformers 5.24's Qwen2MoeConfig sets them: with
    `use_sliding_window`, the layers `layer_types` calls "sliding_attention" (by default the
    even-indexed layers below `max_window_layers`) see the last `sliding_window` keys."""
    use = f.bool("use_sliding_window", False)
    types = f.raw.get("layer_types")
    if types is None:
        below = f.int("max_window_layers", 0, MAX_LAYERS, default=28)
        types = ["sliding_attention" if (i + 1) % 2 and i < below and use else "full_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(f"{f.source}: layer_types must be a list of {num_layers} layer types")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise UnsupportedModelError(f"{f.source}: layer_types entry {repr(t)[:40]} is not supported "
                                        f"('sliding_attention' or 'full_attention')")
    if "sliding_attention" not in types:
        return (None,) * num_layers
    if not use:  # transformers then sets the window to 0, a mask that hides every key
        raise UnsupportedModelError(f"{f.source}: layer_types has sliding layers while use_sliding_window is "
                                    f"false; not supported")
    window = f.int("sliding_window", 1, MAX_POSITIONS)
    return tuple(window if t == "sliding_attention" else None for t in types)


def _expert_activation(f: _Fields) -> str:
    """`hidden_act` (the experts', and Qwen1.5-MoE's shared expert's) as EXPERT_ACTIVATIONS names."""
    act = f.raw.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise UnsupportedModelError(f"{f.source}: hidden_act {repr(act)[:40]} is not supported "
                                    f"({', '.join(HIDDEN_ACTS)})")
    return HIDDEN_ACTS[act]


def read_eos_token_ids(model_dir) -> tuple[int, ...]:
    """The model's EOS ids without a tokenizer: config.json's and generation_config.json's
    `eos_token_id` (an int or a list), so a tokens-only engine never drops the model's EOS."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        raw = read_json_object(path, name, CheckpointError)
        eos = raw.get("eos_token_id")
        values = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise CheckpointError(f"{path}: eos_token_id must be a non-negative integer or a list of them")
        ids.extend(v for v in values if v not in ids)
    return tuple(ids)


# architecture -> parse(ModelConfig, _Fields) for families parsed in their own module, which
# imports this one and registers itself (gemma4_config.py; pagedweight.format imports it), so
# imports run one way.
FAMILY_PARSERS: dict = {}
