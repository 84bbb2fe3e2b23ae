"""Paged attention: both paths against plain causal attention, the varlen model step
against the contiguous forward."""

from __future__ import annotations

import pytest
import torch

from pagedweight.memory.kv_cache import KVCacheConfig, PagedKVCache
from pagedweight.model import load_model
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.paged_attention import SeqSlice, build_step, paged_attention
from tests.conftest import BUNDLED_MODEL


def plain_attention(q, k, v, start, window=None):
    """q [n, N, D] at positions start.., k, v [S, G, D]: softmax attention, no SDPA; with a
    window W, query p sees keys p - W + 1 .. p."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(k_pos <= q_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("impl", ["reference", "batched"])
def test_paths_match_plain_attention_on_odd_lengths(impl, window):
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    G, N, D = config.num_kv_heads, config.num_heads, config.head_dim
    gen = torch.Generator().manual_seed(1)
    kv = PagedKVCache(config, KVCacheConfig(block_size=4), torch.float32, "cpu", num_blocks=30)
    # (context after the step, new tokens): a prefill, a prefill chunk, decodes
    shapes = [(7, 7), (13, 5), (9, 1), (1, 1), (16, 1)]
    free = list(torch.randperm(30, generator=gen).tolist())  # scattered blocks, many chunks
    history = []
    for ctx, n in shapes:
        table = [free.pop() for _ in range(-(-ctx // 4))]
        k, v = torch.randn(ctx, G, D, generator=gen), torch.randn(ctx, G, D, generator=gen)
        if ctx > n:  # the earlier tokens are already cached
            old = build_step(kv, [SeqSlice(table, ctx - n, ctx - n)], "reference")
            paged_attention(0, torch.zeros(ctx - n, N, D), k[: ctx - n], v[: ctx - n], old)
        history.append((table, ctx, n, k, v, torch.randn(n, N, D, generator=gen)))
    step = build_step(kv, [SeqSlice(t, ctx, n) for t, ctx, n, *_ in history], impl)
    q = torch.cat([h[5] for h in history])
    new_k = torch.cat([h[3][h[1] - h[2] :] for h in history])
    new_v = torch.cat([h[4][h[1] - h[2] :] for h in history])
    out = paged_attention(0, q, new_k, new_v, step, window)
    expected = torch.cat([plain_attention(qi, k, v, ctx - n, window) for _, ctx, n, k, v, qi in history])
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() < 1e-5


@torch.inference_mode()
@pytest.mark.parametrize("impl", ["reference", "batched"])
def test_varlen_step_logits_equal_contiguous_forward(impl):
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in (5, 11, 2)]
    kv = PagedKVCache(model.config, KVCacheConfig(block_size=4), torch.float32, "cpu", num_blocks=16)
    tables = [[1, 7], [3, 0, 9], [12]]
    # step 1: prompt 0 whole, prompt 1 only its first 6 tokens, prompt 2 whole
    firsts = [5, 6, 2]
    step = build_step(kv, [SeqSlice(t, n, n) for t, n in zip(tables, firsts)], impl)
    ids = torch.tensor([t for p, n in zip(prompts, firsts) for t in p[:n]])
    logits1 = model.forward_paged(ids, step, torch.tensor([4, 10, 12]))
    # step 2: the rest of prompt 1
    step = build_step(kv, [SeqSlice(tables[1], 11, 5)], impl)
    logits2 = model.forward_paged(torch.tensor(prompts[1][6:]), step, torch.tensor([4]))
    got = [logits1[0], logits2[0], logits1[2]]
    for p, g in zip(prompts, got):
        want = model(torch.tensor([p]))[0, -1]
        assert (g - want).abs().max().item() < 1e-4
    # the partial prefill's last token also equals the contiguous forward at position 5
    assert (logits1[1] - model(torch.tensor([prompts[1][:6]]))[0, -1]).abs().max().item() < 1e-4
