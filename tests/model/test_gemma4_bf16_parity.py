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
