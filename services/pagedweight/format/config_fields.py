"""Which config.json fields each family may carry: an allow-list, so none is ever ignored.

Every top-level field is either read by the family's parser (`_READ`: it is implemented,
or the parser refuses the values it does not implement, naming the field) or listed here
as one that does not change inference (`_INERT`: training-only switches, bookkeeping,
token ids used by tokenizers and padding). Anything else, such as a field a future
`transformers` release adds, is refused at load naming it: a field we do not know might
change the maths, and running the model without it would give other text than the
checkpoint's authors intended.
"""

from __future__ import annotations

from pagedweight.common.errors import UnsupportedModelError

# PreTrainedConfig's own fields and what exporters add beside them; none reaches the maths.
_COMMON_INERT = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache",
    "pad_token_id", "bos_token_id",
    # training only: weight init, dropout (off at inference), router losses and their logits
    "initializer_range", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
})
# Fields every single-RoPE family's parser reads (format/rope_config.py for the RoPE ones).
_COMMON_READ = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_experts_per_tok", "intermediate_size", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
    "rope_parameters", "rope_scaling", "rope_theta", "original_max_position_embeddings",
})
_READ = {
    "MixtralForCausalLM": _COMMON_READ | {"num_local_experts", "num_experts", "sliding_window"},
    "Qwen2MoeForCausalLM": _COMMON_READ | {
        "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "qkv_bias",
        "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "decoder_sparse_step",
        "mlp_only_layers"},
    "Qwen3MoeForCausalLM": _COMMON_READ | {
        "num_experts", "num_local_experts", "moe_intermediate_size", "norm_topk_prob", "attention_bias",
        "use_sliding_window", "sliding_window", "max_window_layers", "decoder_sparse_step", "mlp_only_layers"},
    "OlmoeForCausalLM": _COMMON_READ | {
        "num_experts", "num_local_experts", "norm_topk_prob", "attention_bias", "clip_qkv"},
    "Gemma4ForCausalLM": frozenset({
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "global_head_dim", "num_global_key_value_heads", "per_layer_config", "intermediate_size",
        "moe_intermediate_size", "num_experts", "top_k_experts", "enable_moe_block", "hidden_activation",
        "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "rope_parameters",
        "attention_bias", "attention_k_eq_v", "sliding_window", "layer_types", "final_logit_softcapping",
        "use_bidirectional_attention", "hidden_size_per_layer_input", "num_kv_shared_layers"}),
}
_INERT = {
    # jitter multiplies router inputs only while training
    "MixtralForCausalLM": frozenset({"router_jitter_noise"}),
    "Qwen2MoeForCausalLM": frozenset(),
    "Qwen3MoeForCausalLM": frozenset(),
    "OlmoeForCausalLM": frozenset(),
    # use_double_wide_mlp widens only KV-shared layers' MLPs, vocab_size_per_layer_input only
    # sizes per-layer input embeddings: both refused where they would act
    "Gemma4ForCausalLM": frozenset({"use_double_wide_mlp", "vocab_size_per_layer_input"}),
}


def known_fields(architecture: str) -> frozenset[str]:
    """Every top-level field a config of `architecture` may carry."""
    return _READ[architecture] | _INERT[architecture] | _COMMON_INERT


def inert_fields(architecture: str) -> frozenset[str]:
    """The fields that do not change inference (read by nothing)."""
    return _INERT[architecture] | _COMMON_INERT


def refuse_unknown_fields(raw: dict, architecture: str, source: str) -> None:
    unknown = sorted(set(raw) - known_fields(architecture))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedModelError(
            f"{source}: config field {unknown[0][:60]!r}{more} is not known to PagedWeight for {architecture}; "
            f"it may change the model's output, so the model is refused rather than run without it")
