"""Tiny random checkpoints of the newer MoE families, made with `transformers`' own classes.

Every test builds its checkpoints here, in tmp dirs: nothing is downloaded. Weights are
redrawn with a wider spread than `transformers`' init (std 0.02 leaves the logits nearly
flat, so greedy decoding would barely depend on the model), and every norm weight is
perturbed so a norm applied over the wrong axis cannot go unnoticed.

Two layouts are written for each model: `per_expert` has the
`experts.{e}.gate_proj/up_proj/down_proj.weight` keys of the published checkpoints (what
`save_pretrained` of transformers 5.24 writes for these families, converting back from its
in-memory layout), `fused` has per-layer `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I] tensors, the in-memory layout of transformers 5. Whichever
one `save_pretrained` wrote, the other is made from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import BUNDLED_MODEL

VOCAB = 4096  # the bundled tokenizer's vocabulary, so the quantiser can calibrate on text

FAMILIES = {
    # Qwen3-MoE: per-head q/k norms, head_dim not hidden // heads, biased attention,
    # renormalised top-k, GQA.
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
        kwargs=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
                    attention_bias=True, max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=2),
    ),
    # Qwen3-MoE with `use_sliding_window`: every layer sees only the last 6 keys, so prompts
    # and 64 new tokens run far past the window (in prefill chunks and in decode).
    "qwen3_moe_window": dict(
        cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
        kwargs=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=False,
                    use_sliding_window=True, sliding_window=6, max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=2),
        seed=1,  # seed 0 puts two logits 2e-6 apart on a greedy path: a coin flip, not a test
    ),
    # OLMoE: 64 experts, top-8, q/k norms over the whole projection, no renormalisation.
    "olmoe": dict(
        cls="OlmoeForCausalLM", config="OlmoeConfig",
        kwargs=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_experts=64, num_experts_per_tok=8,
                    intermediate_size=32, norm_topk_prob=False, max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=2),
    ),
    # Gemma-4 MoE: sliding layers (window 6, default RoPE, 2 KV heads of 16) and full layers
    # (proportional RoPE over a quarter of the dims, 1 KV head of 24, values = keys) in
    # one model, q/k/v norms, router and per-expert scales, a dense MLP beside the experts,
    # logit softcapping. The KV slot is the sliding layers' 2 x 16; full layers use 24 of its
    # 32 elements per token (as Gemma-4-26B-A4B's full layers use half of theirs).
    "gemma4_moe": dict(
        cls="Gemma4ForCausalLM", config="Gemma4TextConfig",
        kwargs=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, global_head_dim=24, num_global_key_value_heads=1,
                    attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                    moe_intermediate_size=32, intermediate_size=96, hidden_size_per_layer_input=0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    sliding_window=6, final_logit_softcapping=30.0, max_position_embeddings=512,
                    tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=1),
    ),
}
LAYOUTS = ("fused", "per_expert")
# the offline pipeline, runtime and kernel tests run one config per family
PIPELINE_FAMILIES = ("qwen3_moe", "olmoe", "gemma4_moe")
# 1-D parameters and buffers that are scales (perturbed around 1, not drawn like biases)
_SCALES = (".scale", "per_expert_scale", "layer_scalar")


def reference_model(family: str):
    """The `transformers` model of a family with redrawn random weights (fp32, eval)."""
    import transformers

    spec = FAMILIES[family]
    config = getattr(transformers, spec["config"])(**spec["kwargs"])
    torch.manual_seed(spec.get("seed", 0))
    return redraw_weights(getattr(transformers, spec["cls"])(config).eval())


def redraw_weights(model):
    """Random weights that keep activations O(1) through the layers (transformers' own init
    leaves norms at 1 and biases at 0, which would hide a missing norm or bias), in place,
    from torch's global generator."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(_SCALES):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif param.dim() == 1:  # biases
                param.normal_(0.0, 0.1)
            else:  # scale by fan-in so activations stay O(1) through the layers
                param.normal_(0.0, 1.0 / max(param.shape[-1], 1) ** 0.5)
        for name, buffer in model.named_buffers():  # Gemma-4's per-layer scalar is a buffer
            if name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.3 * torch.randn_like(buffer))
    return model


def save_with_tokenizer(model, out_dir: Path) -> Path:
    """`save_pretrained` with the bundled tokenizer beside it (what `pagedweight generate` reads)."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_MODEL / name, out_dir / name)
    return out_dir


def write_checkpoint(model, out_dir: Path, layout: str) -> Path:
    """Save `model` in one of LAYOUTS, with the bundled tokenizer beside it."""
    out_dir = save_with_tokenizer(model, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    if layout == "per_expert":
        _split_fused_experts(tensors)
    else:
        _fuse_experts(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def _split_fused_experts(tensors: dict) -> None:
    for key in [k for k in tensors if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(key), tensors.pop(prefix + "down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
            tensors[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
            tensors[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()


def _fuse_experts(tensors: dict) -> None:
    prefixes = sorted({k.rsplit(".", 3)[0] for k in tensors if ".experts." in k and k.endswith(".gate_proj.weight")})
    for prefix in prefixes:  # "model.layers.N.mlp.experts"
        count = len([k for k in tensors if k.startswith(prefix + ".") and k.endswith(".gate_proj.weight")])
        gate_up, down = [], []
        for e in range(count):
            gate = tensors.pop(f"{prefix}.{e}.gate_proj.weight")
            up = tensors.pop(f"{prefix}.{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up], dim=0))
            down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)


def config_dict(family: str) -> dict:
    """The family's config.json contents (as `transformers` writes them)."""
    import transformers

    spec = FAMILIES[family]
    config = getattr(transformers, spec["config"])(**spec["kwargs"])
    config.architectures = [spec["cls"]]
    return json.loads(config.to_json_string())
