"""The CUDA path of the page mover: side-stream raises, stream-ordered lowering and
compaction, pinned host planes. While the split between expert bits and KV blocks moves,
every step's output equals the static model at the committed bits, every byte stays
accounted, and the allocator's reserved memory does not grow after the first step (the
arena is the memory). Run on the GPU machine: `make test-gpu`."""

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import check_accounting
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_USED, MemoryPool
from pagedweight.format.apl_format import BlockId
from pagedweight.weights.arena_experts import ArenaExperts
from tests.weights.greedy_planner import GreedyPlanner
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager

KV_BLOCK = 64 * 1024
PAGE = 512
LAYERS, EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 2, 8, 512, 768, 5, 2


def static_expert_sum(table, layer, x, ids, w, cache):
    """The MoE output with every block at its committed bits, dequantised on the CPU
    from host memory (not from the arena)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gu, dn = (_static_weight(table, BlockId(layer, int(ids[t, j]), m), cache) for m in ("gate_up", "down"))
            g, u = (gu @ x[t]).chunk(2)
            out[t] += w[t, j] * (dn @ (F.silu(g) * u))
    return out


def _static_weight(table, bid, cache):
    key = (bid, table.entries[bid].committed_bits)
    if key not in cache:
        cache[key] = table.host[bid].dequantize(key[1]).float()
    return cache[key]


def run_split(device: str, num_steps: int = 60):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(LAYERS, EXPERTS, HIDDEN, INTER, seed=3)
    full = sum(-(-b.nbytes(8) // PAGE) * PAGE + 9 * PAGE for b in blocks.values())  # >= bytes at 8 bits
    pool = MemoryPool(full + 16 * KV_BLOCK)
    arena = Arena.from_pool(pool, PAGE, device)
    arena.storage.fill_(0xFF)  # a read of a page never written shows as garbage
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), kv_block_bytes=KV_BLOCK)
    ops = [ArenaExperts(table, layer, EXPERTS) for layer in range(LAYERS)]
    cache, kv, means, reserved = {}, [], [], []
    for step in range(num_steps):
        if rng.random() < 0.6:  # load rises
            for _ in range(rng.randint(1, 80)):
                if not arena.can_allocate(KV_USED, KV_BLOCK):
                    pager.request_bytes(80 * KV_BLOCK)
                    break
                kv.append(arena.allocate(KV_USED, KV_BLOCK))
                arena.view(kv[-1], torch.uint8, (KV_BLOCK,)).fill_(step % 251)  # KV writes
        else:  # load falls
            for _ in range(rng.randint(0, len(kv))):
                arena.free(kv.pop(rng.randrange(len(kv))))
            pager.offer_bytes(pool.free_bytes - 4 * KV_BLOCK)
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        w = torch.rand(TOKENS, TOP_K, generator=gen)
        for layer, op in enumerate(ops):
            out = op(x.to(device), ids.to(device), w.to(device)).cpu()
            torch.testing.assert_close(out, static_expert_sum(table, layer, x, ids, w, cache), rtol=1e-4, atol=1e-4)
        pager.step_boundary()
        check_accounting(pool, arena, table, mover)
        means.append(pager.stats().mean_committed_bits)
        if device == "cuda":
            reserved.append(torch.cuda.memory_reserved())
    mover.close()
    return pager.stats(), means, reserved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_moves_on_cuda_and_steps_match_the_static_model():
    stats, means, reserved = run_split("cuda")
    assert min(means) < 7.5 and stats.num_page_moves > 0 and stats.num_planes_copied > 0
    rises = sum(b > a for a, b in zip(means, means[1:]))
    assert rises > 1, means
    assert max(reserved) - reserved[0] < 16 << 20, (reserved[0], max(reserved))
