"""Controller overhead at Qwen1.5-MoE-A2.7B's block count (24 layers x 60 experts x 2).

Blocks are small (the point is the Python work per block, not copy bandwidth): each
`step_boundary` is timed when idle, when every block lowers at once (with the compaction
that makes the freed pages usable as KV blocks, worst case: KV had filled every free
page first), and when every block starts a raise. Baseline in the same run: a boundary
with nothing to do. CPU; one JSON in bench/results/pager_scale.json.

    python bench/pager_scale.py
"""

from __future__ import annotations

import json
import time

import torch


from bench.bench_meta import write_result
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_USED, MemoryPool
from pagedweight.weights.in_process_planner import InProcessPlanner, page_table_registration
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager

KV_BLOCK, PAGE = 4096, 256


def timed_ms(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def main():
    torch.set_num_threads(1)
    blocks = random_blocks(24, 60, hidden=64, intermediate=32, seed=0)
    pool = MemoryPool(256 << 20)
    arena = Arena.from_pool(pool, PAGE)
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    load_ms, _ = timed_ms(mover.load_all)
    pager = WeightPager(mover, size_only_planner(table), kv_block_bytes=KV_BLOCK)
    kv = []
    while arena.can_allocate(KV_USED, KV_BLOCK):
        kv.append(arena.allocate(KV_USED, KV_BLOCK))
    idle_ms, _ = timed_ms(pager.step_boundary)
    plan_free_ms, _ = timed_ms(lambda: pager.request_bytes(64 << 20))
    lower_ms, lowered = timed_ms(pager.step_boundary)
    relocated = mover.counters.num_extents_relocated
    got = 0
    while arena.can_allocate(KV_USED, KV_BLOCK) and got < (64 << 20) // KV_BLOCK:
        kv.append(arena.allocate(KV_USED, KV_BLOCK))
        got += 1
    for x in kv:
        arena.free(x)
    plan_spend_ms, _ = timed_ms(lambda: pager.offer_bytes(pool.free_bytes))
    raise_ms, raised = timed_ms(pager.step_boundary)
    mover.wait_for_transits()
    commit_ms, committed = timed_ms(pager.step_boundary)
    mover.close()
    result = {
        "num_blocks": len(table.entries),
        "load_all_ms": round(load_ms, 1),
        "baseline_idle_boundary_ms": round(idle_ms, 2),
        "greedy_plan_free_ms": round(plan_free_ms, 1),
        "lower_all_boundary_ms": round(lower_ms, 1), "num_lowered": len(lowered.lowered_ids),
        "num_extents_relocated": relocated,
        "kv_blocks_gained": got, "kv_blocks_asked": (64 << 20) // KV_BLOCK,
        "greedy_plan_spend_ms": round(plan_spend_ms, 1),
        "raise_all_boundary_ms": round(raise_ms, 1), "num_raises_started": len(raised.started_ids),
        "commit_all_boundary_ms": round(commit_ms, 1), "num_committed": len(committed.committed_ids),
    }
    print(json.dumps(result))
    print(write_result("pager_scale", result))


def size_only_planner(table: PageTable) -> InProcessPlanner:
    """The serving planner over a synthetic table: no artifact, so S_i(b) ~ size * 4^-b."""
    planner = InProcessPlanner("pagedweight")
    planner.register(page_table_registration(table.charged_bytes_table()))
    return planner


if __name__ == "__main__":
    main()
