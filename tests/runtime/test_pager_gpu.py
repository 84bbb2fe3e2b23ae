"""The CUDA path of the page mover: side-stream raises, stream-ordered lowering and
compaction, pinned host planes; outputs equal the static model at the committed bits
every step while the split moves. Run on the GPU machine: `make test-gpu`."""

import random

import pytest
import torch

from conftest import check_accounting
from services.worker.memory.pool import KV_USED
from services.worker.weights.arena_experts import ArenaExperts
from services.worker.weights.greedy_planner import GreedyPlanner
from services.worker.memory.arena import Arena
from services.worker.memory.pool import MemoryPool
from services.worker.weights.apl_format import BlockId
from services.worker.weights.page_mover import PageMover
from services.worker.weights.page_table import PageTable
from services.worker.weights.synthetic import random_blocks
from services.worker.weights.weight_pager import WeightPager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KV_BLOCK = 64 * 1024


def cuda_setup(blocks, extra_bytes):
    full = sum(-(-b.nbytes(8) // 512) * 512 + 9 * 512 for b in blocks.values())  # upper bound at 8 bits
    pool = MemoryPool(full + extra_bytes)
    arena = Arena.from_pool(pool, 512, "cuda")
    arena.storage.fill_(0xFF)
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    return pool, arena, table, mover


def test_split_moves_on_cuda_and_steps_match_the_static_model():
    torch.manual_seed(0)
    rng = random.Random(0)
    layers, experts, hidden, inter = 2, 8, 512, 768
    blocks = random_blocks(layers, experts, hidden, inter, seed=3)
    pool, arena, table, mover = cuda_setup(blocks, 16 * KV_BLOCK)
    assert all(table.host[b].planes.is_pinned() for b in table.entries)
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), kv_block_bytes=KV_BLOCK)
    ops = [ArenaExperts(table, l, experts) for l in range(layers)]
    static_cache = {}
    reserved_start = torch.cuda.memory_reserved()
    kv, means = [], []
    for step in range(60):
        if rng.random() < 0.6:
            for _ in range(rng.randint(1, 40)):
                if not arena.can_allocate(KV_USED, KV_BLOCK):
                    pager.request_bytes(40 * KV_BLOCK)
                    break
                kv.append(arena.allocate(KV_USED, KV_BLOCK))
                arena.view(kv[-1], torch.uint8, (KV_BLOCK,)).fill_(step % 251)
        else:
            for _ in range(rng.randint(0, len(kv))):
                arena.free(kv.pop(rng.randrange(len(kv))))
            pager.offer_bytes(pool.free_bytes - 4 * KV_BLOCK)
        x = torch.randn(5, hidden, device="cuda")
        ids = torch.randint(0, experts, (5, 2), device="cuda")
        w = torch.rand(5, 2, device="cuda")
        for l, op in enumerate(ops):
            out = op(x, ids, w)
            expected = torch.zeros_like(out)
            for t in range(5):
                for j in range(2):
                    gu, dn = (static_weight(table, BlockId(l, int(ids[t, j]), m), static_cache)
                              for m in ("gate_up", "down"))
                    g, u = (gu @ x[t]).chunk(2)
                    expected[t] += w[t, j] * (dn @ (torch.nn.functional.silu(g) * u))
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        pager.step_boundary()
        check_accounting(pool, arena, table, mover)
        means.append(pager.stats().mean_committed_bits)
    assert min(means) < 7 and pager.stats().num_page_moves > 0
    # the arena is the memory: moving the split asked the allocator for no more than
    # the per-step temporaries (dequantised weights of the routed experts)
    growth = torch.cuda.memory_reserved() - reserved_start
    assert growth < 64 << 20, growth
    mover.close()


def static_weight(table, bid, cache):
    """The block at its committed bits, dequantised from host memory (not the arena)."""
    key = (bid, table.entries[bid].committed_bits)
    if key not in cache:
        cache[key] = table.host[bid].dequantize(key[1]).float().cuda()
    return cache[key]
