"""Gemma-4 in bf16 against transformers' Gemma4ForCausalLM, bit for bit.

Gemma-4's router is near-tied at random weights (its scores are H^-1/2-scaled, about 0.02,
so the 8th and 9th of 128 experts at the real shape are a few bf16 steps apart): one bf16
step anywhere moves some token to another expert a few layers on, and the logits far. So
these tests ask for equal bits where fp32 parity (tests/offline/test_real_shape_models.py)
only asks for 1e-4.
With the grouped experts (torch._grouped_mm, what transformers' experts run) our model does
transformers' arithmetic in its order, so equality is expected, not lucky; the per-expert
loop (the CPU default) rounds its products otherwise and is held to a bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from pagedweight.format.model_config import ModelConfig
from pagedweight.offline import real_shape_models as rs
from pagedweight_kernels.moe_reference import grouped_mm_supported, moe_forward


@pytest.fixture(scope="module")
def models():
    """(transformers' model, ours over its tensors, config): tiny-gemma4 in bf16, random
    weights spread so that the routers and the attention depend on them."""
    torch.manual_seed(0)
    hf, raw = rs.build_hf_model("tiny-gemma4", torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    config = ModelConfig.from_dict(raw)
    return hf, rs.ours_from_hf(hf, config), config


def _logits(hf, ours, vocab: int):
    ids = torch.randint(1, vocab, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        return hf(ids).logits, ours(ids)


def test_reference_keeps_transformers_fp32_rope_frequencies(models):
    """build_hf_model in bf16 leaves the RoPE tables fp32, as from_pretrained(dtype=) does:
    rounded to bf16 (a `.to(dtype)` of the whole model) they move cos/sin by a few bf16
    steps at position 15, and the reference stops being transformers'."""
    hf, _, _ = models
    frequencies = {n: b.dtype for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    assert frequencies and set(frequencies.values()) == {torch.float32}, frequencies


@pytest.mark.skipif(not grouped_mm_supported(torch.empty(0)), reason="needs torch._grouped_mm on the CPU")
def test_grouped_experts_give_transformers_bf16_logits_bit_for_bit(models):
    """Sliding and full layers (k = v, their own head dim and KV heads, proportional RoPE),
    routers, experts, softcapping: every bit of transformers' bf16 logits."""
    hf, ours, config = models
    for block in ours.moe_blocks:
        block.experts.grouped = True
    try:
        ref, got = _logits(hf, ours, config.vocab_size)
    finally:
        for block in ours.moe_blocks:
            block.experts.grouped = None
    assert torch.equal(ref, got), f"max |diff| {(ref.float() - got.float()).abs().max():.4g}"


def test_per_expert_loop_within_bf16_rounding(models):
    hf, ours, config = models
    ref, got = _logits(hf, ours, config.vocab_size)
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=0.05 * ref.float().abs().max().item())


def test_router_weights_stay_fp32_and_experts_combine_in_fp32(models):
    """transformers' Gemma-4 router returns its top-k weights in fp32 and its experts weight
    and sum over k in fp32, rounding once: the weights are not rounded to bf16 first."""
    _, ours, config = models
    block = ours.moe_blocks[0]
    x = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    topk_ids, topk_weights = block.router(x)
    assert topk_weights.dtype == torch.float32
    experts = block.experts
    want = torch.stack([
        sum(experts.expert(int(e), x[t:t + 1])[0].float() * w for e, w in zip(topk_ids[t], topk_weights[t]))
        for t in range(x.shape[0])]).to(torch.bfloat16)
    with torch.inference_mode():
        got = moe_forward(x, topk_ids, topk_weights, experts.expert, experts.num_experts)
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order than the reference's may round to a neighbouring bf16 value
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0)
