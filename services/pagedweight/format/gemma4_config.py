"""Gemma-4 MoE text configs (`Gemma4ForCausalLM`, `model_type` "gemma4_text") -> ModelConfig.

What a MoE text configuration (`enable_moe_block`, as Gemma-4-26B-A4B) uses, as
transformers 5.24's `configuration_gemma4.py` / `modeling_gemma4.py` define it:
- `layer_types`: "sliding_attention" / "full_attention" per layer (default: five sliding,
  then one full; the last layer is forced to full, as transformers does);
- per-layer attention shapes: full-attention layers take `global_head_dim` (default 512)
  and, with `attention_k_eq_v`, `num_global_key_value_heads`; a config saved by
  transformers 5.24 states them as `per_layer_config` {layer: {head_dim, num_key_value_heads}};
- `rope_parameters` per layer type: "default" or "proportional" (partial) RoPE;
- `attention_k_eq_v`: full-attention layers have no v_proj, values are the raw keys;
- q/k RMSNorms per head, a scale-free RMSNorm on values, attention scale 1;
- a router (scale-free RMSNorm, learned scale, H^-1/2, softmax, top-k renormalised, then a
  per-expert scale), GELU-tanh experts beside a dense GELU-tanh MLP;
- embeddings scaled by sqrt(hidden_size), a scalar per layer, `final_logit_softcapping`.
Switches that change the maths and that we do not implement are refused naming the field:
dense Gemma-4 (no `enable_moe_block`), per-layer-input embeddings (`hidden_size_per_layer_input`),
KV-shared layers (`num_kv_shared_layers`), bidirectional attention, other activations,
other RoPE types or scaling, per-layer overrides of anything but head_dim / KV heads.
Read and without effect here: `use_double_wide_mlp` (widens only KV-shared layers' MLPs),
`vocab_size_per_layer_input` (only with per-layer input embeddings), `attention_dropout`.
"""

from __future__ import annotations

from pagedweight.common.errors import CheckpointError, UnsupportedModelError
from pagedweight.format.model_config import (
    FAMILY_PARSERS, MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
    LayerAttention, _eos_ids, _Fields,
)

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults (Gemma4TextConfig), used where config.json leaves a key out
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")


def parse_gemma4(cls, f: _Fields):
    """The ModelConfig of a Gemma-4 MoE text config (cls is ModelConfig)."""
    _refuse_unsupported(f)
    hidden = f.int("hidden_size", 1, MAX_HIDDEN, default=2304)
    num_heads = f.int("num_attention_heads", 1, MAX_HEADS, default=8)
    num_layers = f.int("num_hidden_layers", 1, MAX_LAYERS, default=30)
    vocab = f.int("vocab_size", 1, MAX_VOCAB, default=262_144)
    kv_heads = f.int("num_key_value_heads", 1, MAX_HEADS, default=4)
    head_dim = f.int("head_dim", 1, MAX_HEAD_DIM, default=256)
    layer_types = _layer_types(f, num_layers)
    shapes = _layer_shapes(f, layer_types, kv_heads, head_dim)
    window = f.int("sliding_window", 1, MAX_POSITIONS, default=512)
    rope = _rope(f, layer_types)
    k_eq_v = f.bool("attention_k_eq_v", False)
    attention = []
    for layer, kind in enumerate(layer_types):
        g, d = shapes[layer]
        theta, fraction = rope[kind]
        attention.append(LayerAttention(
            num_kv_heads=g, head_dim=d, window=window if kind == SLIDING else None, rope_theta=theta,
            rope_pairs=int(fraction * d // 2),  # transformers' `int(partial_rotary_factor * head_dim // 2)`
            k_eq_v=k_eq_v and kind == FULL))
    bias = f.bool("attention_bias", False)
    return cls(
        architecture="Gemma4ForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=f.int("num_experts", 1, MAX_EXPERTS),
        num_experts_per_tok=f.int("top_k_experts", 1, MAX_EXPERTS),
        expert_intermediate_size=f.int("moe_intermediate_size", 1, MAX_INTERMEDIATE),
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
        attention_bias=bias,
        rms_norm_eps=f.float("rms_norm_eps", 0.0, 1.0, default=1e-6),
        rope_theta=rope[SLIDING if SLIDING in rope else FULL][0],
        max_position_embeddings=f.int("max_position_embeddings", 1, MAX_POSITIONS, default=131_072),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        eos_token_ids=_eos_ids(f, vocab) if "eos_token_id" in f.raw else (1,) if vocab > 1 else (),
        qk_norm="head",
        o_proj_bias=bias,
        expert_activation="gelu_tanh",
        layer_attention=tuple(attention),
        v_norm=True,
        attention_scale=1.0,  # the q/k norms stand in for 1/sqrt(head_dim)
        dense_intermediate_size=f.int("intermediate_size", 1, MAX_INTERMEDIATE, default=9216),
        final_logit_softcapping=f.float("final_logit_softcapping", 0.0, 1e6, default=None),
    )


def _refuse_unsupported(f: _Fields) -> None:
    raw, source = f.raw, f.source
    if raw.get("enable_moe_block") is not True:
        raise UnsupportedModelError(f"{source}: enable_moe_block is not true: dense Gemma-4 models are not "
                                    f"supported (PagedWeight pages routed experts)")
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{source}: hidden_activation {repr(act)[:40]} is not supported "
                                    f"(Gemma-4 experts run gelu_pytorch_tanh)")
    if raw.get("hidden_size_per_layer_input"):
        raise UnsupportedModelError(f"{source}: hidden_size_per_layer_input (per-layer input embeddings) "
                                    f"is not supported")
    if raw.get("num_kv_shared_layers"):
        raise UnsupportedModelError(f"{source}: num_kv_shared_layers (layers reusing another layer's KV) "
                                    f"is not supported")
    if raw.get("use_bidirectional_attention") is not None:
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported (causal only)")


def _layer_types(f: _Fields, num_layers: int) -> list[str]:
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default pattern: five sliding layers, then a full one
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(f"{f.source}: layer_types must be a list of {num_layers} layer types")
    for t in types:
        if t not in (SLIDING, FULL):
            raise UnsupportedModelError(f"{f.source}: layer_types entry {repr(t)[:40]} is not supported "
                                        f"({SLIDING!r} or {FULL!r})")
    return types[:-1] + [FULL]  # transformers forces the last layer to full attention


def _layer_shapes(f: _Fields, layer_types: list[str], kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(KV heads, head dim) per layer."""
    raw, source = f.raw, f.source
    shapes = [(kv_heads, head_dim)] * len(layer_types)
    overrides = raw.get("per_layer_config")
    if overrides is None:  # an original config: full layers take the global shape
        global_dim = f.int("global_head_dim", 1, MAX_HEAD_DIM, default=512)
        global_kv = f.int("num_global_key_value_heads", 1, MAX_HEADS, default=None)
        if not f.bool("attention_k_eq_v", False):
            global_kv = None  # transformers applies it only with attention_k_eq_v
        overrides = {i: {"head_dim": global_dim, **({"num_key_value_heads": global_kv} if global_kv else {})}
                     for i, t in enumerate(layer_types) if t == FULL}
    if not isinstance(overrides, dict):
        raise CheckpointError(f"{source}: per_layer_config must be an object")
    for key, layer_raw in overrides.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise CheckpointError(f"{source}: per_layer_config key {repr(key)[:20]} is not a layer index") from None
        if not 0 <= layer < len(layer_types) or not isinstance(layer_raw, dict):
            raise CheckpointError(f"{source}: per_layer_config[{repr(key)[:20]}] must be an object for a layer "
                                  f"in 0..{len(layer_types) - 1}")
        unknown = sorted(set(layer_raw) - set(_LAYER_OVERRIDES))
        if unknown:
            raise UnsupportedModelError(f"{source}: per_layer_config overrides {unknown[0]!r} of layer {layer}; "
                                        f"only {', '.join(_LAYER_OVERRIDES)} may differ between layers")
        fields = _Fields(layer_raw, f"{source} per_layer_config[{layer}]")
        shapes[layer] = (fields.int("num_key_value_heads", 1, MAX_HEADS, default=shapes[layer][0]),
                         fields.int("head_dim", 1, MAX_HEAD_DIM, default=shapes[layer][1]))
    return shapes


def _rope(f: _Fields, layer_types: list[str]) -> dict[str, tuple[float, float]]:
    """layer type -> (rope_theta, partial rotary fraction)."""
    params = f.raw.get("rope_parameters")
    params = DEFAULT_ROPE if params is None else params
    if not isinstance(params, dict):
        raise CheckpointError(f"{f.source}: rope_parameters must be an object keyed by layer type")
    out = {}
    for kind in sorted(set(layer_types)):
        p = params.get(kind)
        if not isinstance(p, dict):
            raise CheckpointError(f"{f.source}: rope_parameters has no object for {kind!r}")
        fields = _Fields(p, f"{f.source} rope_parameters[{kind!r}]")
        rope_type = p.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise UnsupportedModelError(f"{f.source}: rope_parameters[{kind!r}] rope_type {repr(rope_type)[:40]} "
                                        f"is not supported (default or proportional)")
        if p.get("factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"{f.source}: rope_parameters[{kind!r}] factor (RoPE scaling) "
                                        f"is not supported")
        fraction = fields.float("partial_rotary_factor", 0.0, 1.0, default=1.0)
        if rope_type == "default" and fraction != 1.0:  # transformers' default RoPE ignores it: refuse
            raise UnsupportedModelError(f"{f.source}: rope_parameters[{kind!r}] partial_rotary_factor with "
                                        f"rope_type 'default' is not supported")
        out[kind] = (fields.float("rope_theta", 0.0, 1e12, default=10_000.0), fraction)
    return out


FAMILY_PARSERS["Gemma4ForCausalLM"] = parse_gemma4
