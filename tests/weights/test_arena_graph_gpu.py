"""CUDA-graph replays of the fused kernel stay right while the pager moves bits.

A graph of each layer's experts call is captured once; between steps the pager lowers,
raises and compacts blocks, `ArenaExperts.graph_state` rewrites the descriptor rows in
place, and a layer is captured again only when its launch signature (bit classes, widest
bits) changed. Every replay is compared with the static model at the committed bits,
dequantised on the CPU from host memory. Run on the GPU machine: `make test-gpu`."""

import random

import pytest
import torch

from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_USED, MemoryPool
from pagedweight.weights.arena_experts import ArenaExperts
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager
from tests.weights.greedy_planner import GreedyPlanner
from tests.weights.test_pager_gpu import EXPERTS, HIDDEN, INTER, KV_BLOCK, LAYERS, PAGE, TOKENS, TOP_K, static_expert_sum


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stable", [False, True])
def test_replays_follow_the_page_table_while_bits_move(stable):
    """stable: the layers' decode launches do not follow their bits (a pager's runtime), so
    each layer is captured once and every later step replays it, through every page move."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks(LAYERS, EXPERTS, HIDDEN, INTER, seed=4)
    full = sum(-(-b.nbytes(8) // PAGE) * PAGE + 9 * PAGE for b in blocks.values())
    pool = MemoryPool(full + 16 * KV_BLOCK)
    arena = Arena.from_pool(pool, PAGE, "cuda")
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), kv_block_bytes=KV_BLOCK)
    ops = [ArenaExperts(table, layer, EXPERTS, stable_launches=stable) for layer in range(LAYERS)]
    dtype = torch.bfloat16
    x_s = torch.zeros(TOKENS, HIDDEN, dtype=dtype, device="cuda")
    ids_s = torch.zeros(TOKENS, TOP_K, dtype=torch.int64, device="cuda")
    w_s = torch.zeros(TOKENS, TOP_K, dtype=dtype, device="cuda")
    graphs = [None] * LAYERS  # (graph, output, signature)
    cache, kv, captures, replays = {}, [], 0, 0
    for step in range(40):
        if rng.random() < 0.6:
            for _ in range(rng.randint(1, 80)):
                if not arena.can_allocate(KV_USED, KV_BLOCK):
                    pager.request_bytes(80 * KV_BLOCK)
                    break
                kv.append(arena.allocate(KV_USED, KV_BLOCK))
        else:
            for _ in range(rng.randint(0, len(kv))):
                arena.free(kv.pop(rng.randrange(len(kv))))
            pager.offer_bytes(pool.free_bytes - 4 * KV_BLOCK)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        w = torch.rand(TOKENS, TOP_K, generator=gen).to(dtype)
        x_s.copy_(x), ids_s.copy_(ids), w_s.copy_(w)
        for layer, op in enumerate(ops):
            sig = op.graph_state(dtype)
            assert sig is not None
            if graphs[layer] is None or graphs[layer][2] != sig:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    op(x_s, ids_s, w_s)  # warm-up: kernel compilation stays out of the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = op(x_s, ids_s, w_s)
                graphs[layer] = (graph, out, sig)
                captures += 1
            graphs[layer][0].replay()
            replays += 1
            got = graphs[layer][1].float().cpu()
            want = static_expert_sum(table, layer, x.float(), ids, w.float(), cache)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 2e-2, (step, layer, rel)
        pager.step_boundary()
    mover.close()
    assert pager.stats().num_page_moves > 0 and replays > captures  # replays outlived page moves
    if stable:
        assert captures == LAYERS
