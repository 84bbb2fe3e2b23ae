"""A generator of tiny random checkpoints across the configuration fields that change the maths.

Each case is a family's base configuration (small: 2-4 layers, hidden 64, a 4096-token
vocabulary so the bundled tokenizer can write the text) with a few fields changed, made by
`transformers`' own config and model classes and saved with `save_pretrained`, so the
config.json is what a user's checkpoint would carry. Weights are redrawn as in
families.reference_model (wide enough that greedy decoding depends on them, every norm
perturbed).

`CASES` covers, per family, what its config class defines that alters inference: expert
normalisation, q/k norms and their bias switches, sliding-window layouts (every layer,
`max_window_layers`, explicit `layer_types`), each implemented RoPE scaling type, tied
embeddings, shared experts, activations, head dims unlike hidden / heads, GQA, softcapping,
and fields that must not change inference (router jitter, aux-loss coefficients). `REFUSED`
lists configurations we do not run: each must fail at load naming its field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.model.families import VOCAB, redraw_weights

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
BASES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, max_position_embeddings=512,
        rope_parameters=_ROPE, eos_token_id=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        intermediate_size=96, max_position_embeddings=512, rope_parameters=_ROPE, eos_token_id=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
        max_position_embeddings=512, rope_parameters=_ROPE, eos_token_id=2)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=4, intermediate_size=32, max_position_embeddings=512,
        rope_parameters=_ROPE, eos_token_id=2)),
    "gemma4_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, intermediate_size=96, hidden_size_per_layer_input=0, sliding_window=5,
        max_position_embeddings=512, eos_token_id=2, pad_token_id=0, bos_token_id=1)),
}

_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
_YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0}
_YARN_ATTENTION = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
                   "attention_factor": 1.3, "truncate": False}
_INERT = dict(router_aux_loss_coef=0.5, output_router_logits=True, attention_dropout=0.3, initializer_range=0.5)


@dataclass(frozen=True)
class Case:
    family: str  # a key of BASES
    name: str
    changes: dict = field(default_factory=dict)  # config fields on top of the family's base
    seed: int = 0

    @property
    def id(self) -> str:
        return f"{self.family}-{self.name}"


def _cases() -> list[Case]:
    cases = []

    def add(family, name, **changes):
        cases.append(Case(family, name, changes))

    for family in BASES:
        add(family, "base")
        add(family, "tied", tie_word_embeddings=family != "gemma4_moe")
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        add(family, "rope-linear", rope_parameters=_LINEAR)
        add(family, "rope-llama3", rope_parameters=_LLAMA3)
        add(family, "rope-yarn", rope_parameters=_YARN, head_dim=16)
        add(family, "rope-yarn-mscale", rope_parameters=_YARN_MSCALE, head_dim=16)
        add(family, "rope-yarn-attention-factor", rope_parameters=_YARN_ATTENTION, head_dim=16)
        add(family, "rope-theta", rope_parameters={"rope_type": "default", "rope_theta": 37.0})
        add(family, "gelu-tanh", hidden_act="gelu_pytorch_tanh")
        add(family, "mha-eps", num_key_value_heads=4, rms_norm_eps=1e-2)
    add("mixtral", "inert-fields", router_jitter_noise=0.5, **_INERT)
    add("mixtral", "sliding-window", sliding_window=5)
    add("mixtral", "head-dim", head_dim=24, num_key_value_heads=1)
    add("mixtral", "top1", num_experts_per_tok=1)
    add("qwen2_moe", "norm-topk", norm_topk_prob=True)
    add("qwen2_moe", "no-qkv-bias", qkv_bias=False)
    add("qwen2_moe", "no-shared-expert", shared_expert_intermediate_size=0)
    add("qwen2_moe", "inert-fields", **_INERT)
    add("qwen2_moe", "head-dim", head_dim=24)
    # transformers windows the even layers below max_window_layers
    add("qwen2_moe", "window-layers", use_sliding_window=True, sliding_window=5, max_window_layers=2)
    add("qwen2_moe", "window-all", use_sliding_window=True, sliding_window=4, max_window_layers=3)
    add("qwen2_moe", "layer-types", use_sliding_window=True, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    add("qwen2_moe", "window-off", use_sliding_window=False, sliding_window=5, max_window_layers=1)
    add("qwen3_moe", "norm-topk", norm_topk_prob=True)
    add("qwen3_moe", "attention-bias", attention_bias=True)
    add("qwen3_moe", "head-dim", head_dim=24, num_key_value_heads=1)
    add("qwen3_moe", "sliding-window", use_sliding_window=True, sliding_window=5)
    add("qwen3_moe", "window-off", use_sliding_window=False, sliding_window=5)
    add("qwen3_moe", "inert-fields", **_INERT)
    add("olmoe", "norm-topk", norm_topk_prob=True)
    add("olmoe", "attention-bias", attention_bias=True)
    add("olmoe", "gqa", num_key_value_heads=2)
    add("olmoe", "clip-qkv", clip_qkv=0.5)
    add("olmoe", "inert-fields", **_INERT)
    add("gemma4_moe", "k-eq-v", attention_k_eq_v=True, num_global_key_value_heads=1)
    add("gemma4_moe", "no-softcap", final_logit_softcapping=None)
    add("gemma4_moe", "softcap", final_logit_softcapping=3.0)
    add("gemma4_moe", "untied", tie_word_embeddings=False)
    add("gemma4_moe", "attention-bias", attention_bias=True)
    add("gemma4_moe", "layer-types", layer_types=["full_attention", "sliding_attention", "full_attention"])
    add("gemma4_moe", "rope", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5000.0}})
    add("gemma4_moe", "top1", top_k_experts=1, rms_norm_eps=1e-2)
    return cases


CASES = _cases()

# (family, field, value): configurations that change the maths in ways we do not run
REFUSED = [
    ("mixtral", "hidden_act", "relu"),
    ("mixtral", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ("qwen2_moe", "decoder_sparse_step", 2),
    ("qwen2_moe", "mlp_only_layers", [1]),
    ("qwen3_moe", "mlp_only_layers", [0]),
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}),
    ("olmoe", "hidden_act", "gelu"),
    ("gemma4_moe", "hidden_activation", "gelu"),
    ("gemma4_moe", "num_kv_shared_layers", 1),
]


def reference_model(case: Case):
    """The `transformers` model of a case (fp32, eval, eager attention) with redrawn weights."""
    import transformers

    cls, config_cls, base = BASES[case.family]
    config = getattr(transformers, config_cls)(**{**base, **case.changes})
    config._attn_implementation = "eager"
    torch.manual_seed(case.seed)
    return redraw_weights(getattr(transformers, cls)(config).eval())


def config_dict(family: str, changes: dict | None = None) -> dict:
    """The config.json `transformers` writes for a family's base with `changes`."""
    import transformers

    cls, config_cls, base = BASES[family]
    config = getattr(transformers, config_cls)(**{**base, **(changes or {})})
    config.architectures = [cls]
    return json.loads(config.to_json_string())
