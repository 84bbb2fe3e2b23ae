"""Paged decode attention in place: the tile-offset contract of the KV cache, and
the in-place path against plain attention on odd lengths, scattered blocks, sliding
windows and released blocks; on CUDA the Triton kernel against the torch path."""

from __future__ import annotations

import pytest
import torch

from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import RELEASED, KVCacheConfig, PagedKVCache
from pagedweight.model.paged_attention import SeqSlice, build_step, paged_attention
from pagedweight_kernels.paged_decode import (
    combine_splits, combine_splits_triton, num_splits, paged_decode_torch, paged_decode_triton, triton_available)
from tests.conftest import BUNDLED_MODEL
from tests.model.test_paged_attention import plain_attention


def _cache(block_size=4, num_blocks=40, dtype=torch.float32, device="cpu"):
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    return config, PagedKVCache(config, KVCacheConfig(block_size=block_size), dtype, device, num_blocks=num_blocks)


def test_tile_offsets_point_at_what_read_blocks_returns():
    config, kv = _cache()
    kv.flat.copy_(torch.randn(kv.flat.shape, generator=torch.Generator().manual_seed(3)))
    tile = kv.block_size * kv.num_kv_heads * kv.head_dim
    gen = torch.Generator().manual_seed(4)
    for layer in range(config.num_layers):
        table = torch.randint(0, 40, (3, 5), generator=gen)
        k_off, v_off = kv.kv_tile_offsets(layer, table)
        k, v = kv.read_blocks(layer, table.reshape(-1))
        got_k = torch.stack([kv.flat[o: o + tile] for o in k_off.reshape(-1).tolist()])
        got_v = torch.stack([kv.flat[o: o + tile] for o in v_off.reshape(-1).tolist()])
        assert torch.equal(got_k, k.reshape(len(got_k), -1)) and torch.equal(got_v, v.reshape(len(got_v), -1))
    # released / padding entries read block 0 (and are masked by the attention)
    k_off, v_off = kv.kv_tile_offsets(1, torch.tensor([RELEASED, -5]))
    assert torch.equal(k_off, kv.kv_tile_offsets(1, torch.tensor([0, 0]))[0])


def _decode_history(kv, shapes, gen, window=None):
    """Sequences with cached context and one new token each: (table, ctx, k, v, q)."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    G, N, D = config.num_kv_heads, config.num_heads, config.head_dim
    free = torch.randperm(kv.num_blocks, generator=gen).tolist()  # scattered blocks
    history = []
    for ctx in shapes:
        table = [free.pop() for _ in range(-(-ctx // kv.block_size))]
        k, v = torch.randn(ctx, G, D, generator=gen), torch.randn(ctx, G, D, generator=gen)
        if ctx > 1:
            old = build_step(kv, [SeqSlice(table, ctx - 1, ctx - 1)], "reference")
            paged_attention(0, torch.zeros(ctx - 1, N, D), k[:-1], v[:-1], old)
        history.append((table, ctx, k, v, torch.randn(1, N, D, generator=gen)))
    return history


@pytest.mark.parametrize("window", [None, 3, 6])
def test_inplace_decode_matches_plain_attention(window):
    gen = torch.Generator().manual_seed(5)
    _, kv = _cache()
    history = _decode_history(kv, [1, 9, 16, 17, 30, 5], gen)
    step = build_step(kv, [SeqSlice(t, ctx, 1) for t, ctx, *_ in history], "inplace")
    assert step.impl == "inplace"
    q = torch.cat([h[4] for h in history])
    out = paged_attention(0, q, torch.stack([h[2][-1] for h in history]),
                          torch.stack([h[3][-1] for h in history]), step, window)
    want = torch.cat([plain_attention(qi, k, v, ctx - 1, window) for _, ctx, k, v, qi in history])
    assert (out - want).abs().max().item() < 1e-5


def test_inplace_decode_ignores_released_blocks():
    """A sliding-window sequence whose early blocks were given back (and reused by another
    sequence with other values) attends as if they were still there: they are outside the
    window, so nothing is read from them."""
    gen = torch.Generator().manual_seed(6)
    _, kv = _cache()
    window = 5
    (table, ctx, k, v, q), = _decode_history(kv, [23], gen)
    released = [RELEASED if i < (ctx - window) // kv.block_size else b for i, b in enumerate(table)]
    rows = kv._tile_row  # [L, blocks] -> the tile row of each layer's part of a block
    kv.tiles[rows[:, 0]] = float("nan")  # block 0 (what released entries map to) poisoned
    last = table[-1]  # and the last block's slots past the length (stale bytes in an arena)
    kv.tiles[rows[:, last], :, ctx % kv.block_size:] = float("nan")
    for b in table[: (ctx - window) // kv.block_size]:
        kv.tiles[rows[:, b]] = float("nan")  # the blocks given back now hold someone else's data
    step = build_step(kv, [SeqSlice(released, ctx, 1)], "inplace")
    out = paged_attention(0, q, k[-1:], v[-1:], step, window)
    assert torch.isfinite(out).all()
    assert (out - plain_attention(q, k, v, ctx - 1, window)).abs().max().item() < 1e-5


def test_inplace_falls_back_to_batched_with_a_prefill_chunk():
    _, kv = _cache()
    step = build_step(kv, [SeqSlice([1, 2], 6, 3), SeqSlice([3], 2, 1)], "inplace")
    assert step.impl == "batched"


def test_torch_chunks_agree_and_splits_combine():
    """Chunked online softmax equals one chunk; partials of disjoint key ranges combine to
    the whole (the kernel's split merge)."""
    gen = torch.Generator().manual_seed(8)
    _, kv = _cache(num_blocks=60)
    history = _decode_history(kv, [40, 3, 57], gen)
    step = build_step(kv, [SeqSlice(t, ctx, 1) for t, ctx, *_ in history], "inplace")
    q = torch.cat([h[4] for h in history])
    k_off, v_off = kv.kv_tile_offsets(0, step.block_table)
    args = (q, kv.flat, k_off, v_off, step.seq_context_lens, kv.block_size, kv.num_kv_heads)
    one = paged_decode_torch(*args, block_table=step.block_table, chunk_blocks=1000)
    many = paged_decode_torch(*args, block_table=step.block_table, chunk_blocks=1)
    assert (one - many).abs().max().item() < 1e-5
    m = torch.tensor([[[1.0, float("-inf")]]])
    l_sum = torch.tensor([[[2.0, 0.0]]])
    acc = torch.tensor([[[[4.0], [0.0]]]])
    assert combine_splits(m, l_sum, acc).item() == 2.0
    assert num_splits(1, 16, 2048) > 1 and num_splits(64, 16, 8) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("block_size,heads", [(16, (16, 16)), (16, (32, 8)), (4, (8, 2))])
def test_triton_kernel_matches_torch_path(dtype, window, block_size, heads):
    N, G = heads
    D = 128 if block_size == 16 else 64
    gen = torch.Generator(device="cuda").manual_seed(9)
    num_blocks = 600
    flat = torch.randn(num_blocks * 2 * block_size * G * D * 2, device="cuda", generator=gen).to(dtype)
    lens = [1, 17, 4099 if block_size == 16 else 333, 64, 5, 2000 if block_size == 16 else 100]
    B = len(lens)
    W = max(-(-n // block_size) for n in lens)
    table = torch.full((B, W), -1, dtype=torch.int64)
    perm = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        table[b, :nb] = torch.tensor(perm[:nb]) if nb <= len(perm) else 0
        perm = perm[nb:] or torch.randperm(num_blocks).tolist()
    if window is not None:  # released blocks before the window of the long sequence
        table[2, : max(0, (lens[2] - window) // block_size)] = -1
    table = table.cuda()
    stride = 2 * 2 * block_size * G * D  # two layers: read layer 1
    tile = block_size * G * D
    k_off = table.clamp_min(0) * stride + 2 * tile
    v_off = k_off + tile
    ctx = torch.tensor(lens, device="cuda")
    q = torch.randn(B, N, D, device="cuda", generator=gen).to(dtype)
    want = paged_decode_torch(q.float(), flat.float(), k_off, v_off, ctx, block_size, G, window, table)
    for splits, tiles in ((None, 4), (1, 1), (7, 2), (3, 4)):
        got = paged_decode_triton(q, flat, k_off, v_off, ctx, block_size, G, window, table, splits=splits,
                                  tiles_per_iter=tiles)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert torch.isfinite(got).all() and err < (1e-5 if dtype == torch.float32 else 1e-2), (splits, tiles, err)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 5, 32])
def test_split_combine_kernel_equals_the_torch_combine(dtype, splits):
    """The one-launch combine against combine_splits, with empty splits (m = -inf, l = 0,
    acc = 0) in every row but the first split."""
    gen = torch.Generator().manual_seed(splits)
    B, N, D = 3, 8, 128
    m = torch.randn(B, N, splits, generator=gen) * 3
    l_sum = torch.rand(B, N, splits, generator=gen) + 0.5
    acc = torch.randn(B, N, splits, D, generator=gen)
    empty = torch.rand(B, N, splits, generator=gen) < 0.4
    empty[..., 0] = False
    m[empty], l_sum[empty] = float("-inf"), 0.0
    acc[empty] = 0.0
    m, l_sum, acc = m.cuda(), l_sum.cuda(), acc.cuda()
    want = combine_splits(m, l_sum, acc).to(dtype)
    got = combine_splits_triton(m, l_sum, acc, dtype)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_inplace_decode_of_a_layer_narrower_than_the_slot(window):
    """Gemma-4's full-attention layers are narrower than the cache's slot (kv_slot): their
    token rows sit at the front of each slot row. The in-place path reads them there
    (row_elems) and agrees with the reference path, which cuts whole slots to the layer."""
    gen = torch.Generator().manual_seed(8)
    config, kv = _cache()
    G, D = 1, kv.head_dim // 2  # a narrower layer: fewer heads, smaller head dim
    assert G * D < kv.num_kv_heads * kv.head_dim
    N = config.num_heads
    free = torch.randperm(kv.num_blocks, generator=gen).tolist()
    seqs, qs, new_k, new_v = [], [], [], []
    for ctx in [1, 7, 13, 21]:
        table = [free.pop() for _ in range(-(-ctx // kv.block_size))]
        k, v = torch.randn(ctx, G, D, generator=gen), torch.randn(ctx, G, D, generator=gen)
        if ctx > 1:
            old = build_step(kv, [SeqSlice(table, ctx - 1, ctx - 1)], "reference")
            paged_attention(0, torch.zeros(ctx - 1, N, D), k[:-1], v[:-1], old)
        seqs.append(SeqSlice(table, ctx, 1))
        qs.append(torch.randn(1, N, D, generator=gen))
        new_k.append(k[-1:])
        new_v.append(v[-1:])
    q, k, v = torch.cat(qs), torch.cat(new_k), torch.cat(new_v)
    outs = {impl: paged_attention(0, q, k, v, build_step(kv, seqs, impl), window, scale=0.7)
            for impl in ("reference", "inplace")}
    assert (outs["inplace"] - outs["reference"]).abs().max().item() < 1e-5


def test_one_split_combines_as_the_general_path():
    """One split (large batches) skips the max/exp weighting: the same as combining it
    with an empty split (m = -inf, l = 0, acc = 0), which takes the general path."""
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(3, 4, 1, generator=gen)
    l_sum = torch.rand(3, 4, 1, generator=gen) + 0.5
    acc = torch.randn(3, 4, 1, 8, generator=gen)
    one = combine_splits(m, l_sum, acc)
    two = combine_splits(torch.cat([m, torch.full_like(m, float("-inf"))], -1),
                         torch.cat([l_sum, torch.zeros_like(l_sum)], -1),
                         torch.cat([acc, torch.zeros_like(acc)], -2))
    assert one.shape == (3, 4, 8)
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)
