"""Real-shape model configurations for benchmarks that build random-weight models at the
published sizes (no checkpoint download: only the shapes matter for memory and speed).

Each entry is the `config.json` dict `ModelConfig.from_dict` reads, with the fields the
published checkpoints carry; `PUBLISHED_PARAMS` is the total parameter count the model
cards state, which tests/offline/test_real_shape_configs.py checks our shapes against.

Gemma-4-26B-A4B is the text config (`text_config`) of the published multimodal checkpoint,
written as transformers 5.17 read it: the full-attention layers' shape as `global_head_dim`
/ `num_global_key_value_heads` (ModelConfig reads it as transformers does, and also the
`per_layer_config` form transformers 5.24 saves); RoPE, activation and the 5:1 layer
pattern are transformers' Gemma4TextConfig defaults.
"""

from __future__ import annotations

from pagedweight.format.model_config import ModelConfig

REAL_SHAPE_CONFIGS: dict[str, dict] = {
    "Gemma-4-26B-A4B": {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144,
        "hidden_size": 2816, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "num_global_key_value_heads": 2, "global_head_dim": 512,
        "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "intermediate_size": 2112, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        "use_bidirectional_attention": None, "attention_bias": False, "sliding_window": 1024,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "tie_word_embeddings": True, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "intermediate_size": 6144, "norm_topk_prob": True, "attention_bias": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "eos_token_id": 151645,
    },
    "OLMoE-1B-7B": {
        "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 1024,
        "norm_topk_prob": False, "attention_bias": False, "clip_qkv": None, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "eos_token_id": 50279,
    },
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "eos_token_id": 2,
    },
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "eos_token_id": 151643,
    },
}

# Total parameters from the model cards, in billions (rounded as published).
# Gemma-4-26B-A4B: 25.97B is what parameter_count gives: it counts
# lm_head apart from the embedding it is tied to (25.23B distinct parameters).
PUBLISHED_PARAMS = {"Gemma-4-26B-A4B": 25.97, "Qwen3-30B-A3B": 30.5, "OLMoE-1B-7B": 6.92, "Mixtral-8x7B": 46.7, "Qwen1.5-MoE-A2.7B": 14.3}


def real_shape_config(name: str) -> ModelConfig:
    if name not in REAL_SHAPE_CONFIGS:
        raise KeyError(f"no real-shape config {name!r}; known: {', '.join(REAL_SHAPE_CONFIGS)}")
    return ModelConfig.from_dict(REAL_SHAPE_CONFIGS[name], source=f"real-shape config {name}")


def parameter_count(config: ModelConfig) -> int:
    """Total parameters of a model with this config, counted from its shapes (what a meta-device
    `MoECausalLM(config)` holds)."""
    from pagedweight.model.transformer import MoECausalLM
    import torch

    with torch.device("meta"):
        model = MoECausalLM(config)
    return sum(p.numel() for p in model.parameters())
