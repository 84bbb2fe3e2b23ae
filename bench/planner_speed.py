"""The controllers' speed on the CPU: the median (and p90) of repeated calls after a warm-up.

Plans: every policy's plan from 8 bits (the most work a plan does) on a synthetic table at
Qwen1.5-MoE-A2.7B size, and the online planner's tick, against a pure-Python heapq greedy on
the same inputs. `--controllers`: the planner, pager, page table and routing feed at SHAPES
block counts (tiny blocks sharing host tensors: the point is the work per block).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import sys

import numpy as np
import torch

from bench.bench_meta import arg_parser, seconds, write_result
from pagedweight.format.blocks import MODULES, BlockId
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import MemoryPool
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
from pagedweight.planner.planner import OnlinePlanner
from pagedweight.planner.policies import POLICY_NAMES, PlanContext, make_policy
from pagedweight.planner.synthetic import QWEN15_MOE_A27B, synthetic_table
from pagedweight.planner.tables import BlockTable
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.routing_feed import RoutingFeed
from pagedweight.weights.synthetic import random_block
from pagedweight.weights.weight_pager import WeightPager

TARGET_MS = 5.0
WIDTHS = (3, 3.5, 4, 5)
REPEATS = 40
SHAPES = {2880: (24, 60), 12288: (48, 128), 30000: (60, 250)}  # blocks -> (layers, experts)


def timed_ms(fn, repeats: int = REPEATS) -> dict:
    for _ in range(3):
        fn()
    times = sorted(1e3 * seconds(fn) for _ in range(repeats))
    return {"median_ms": round(statistics.median(times), 3), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3)}


def heap_solve(damage: np.ndarray, nbytes: np.ndarray, budget: int) -> np.ndarray:
    """Baseline: all blocks at 8 bits, pop the cheapest damage-per-byte step until within budget."""
    bits = np.full(len(nbytes), 8)
    excess = int(nbytes[:, 5].sum()) - budget
    heap = [((damage[i, 4] - damage[i, 5]) / (nbytes[i, 5] - nbytes[i, 4]), i) for i in range(len(bits))]
    heapq.heapify(heap)
    while heap and excess > 0:
        _, i = heapq.heappop(heap)
        b = bits[i] - 3
        excess -= int(nbytes[i, b] - nbytes[i, b - 1])
        bits[i] -= 1
        if bits[i] > 3:
            c = b - 1
            heapq.heappush(heap, ((damage[i, c - 1] - damage[i, c]) / (nbytes[i, c] - nbytes[i, c - 1]), i))
    return bits


def online_ticks(table) -> dict:
    """A tick at a new budget, alternating pressure up and down between 4 and 4.6 bits."""
    planner = OnlinePlanner(table, DamageModel(table), np.full(table.num_blocks, 8))
    inputs = DamageInputs(table.calib_mass / table.calib_mass.mean(axis=1, keepdims=True))
    planner.plan(table.uniform_bytes(4.0), inputs)
    budgets = itertools.cycle([table.uniform_bytes(w) for w in (4.6, 4.0)])
    return timed_ms(lambda: planner.plan(next(budgets), inputs))


def plans() -> dict:
    table = synthetic_table(*QWEN15_MOE_A27B, seed=0)
    residual = np.random.default_rng(1).normal(0, 0.3, size=table.num_blocks)
    context = PlanContext(table.calib_mass / table.calib_mass.mean(axis=1, keepdims=True), residual)
    results = {}
    for name in POLICY_NAMES:
        policy = make_policy(name, table)
        for width in WIDTHS:
            budget = table.uniform_bytes(width)
            if name == "mxmoe":  # solved once per budget by design; time the solve itself
                results[f"{name}@{width}"] = timed_ms(lambda: make_policy(name, table).plan(budget, context))
            else:
                results[f"{name}@{width}"] = timed_ms(lambda: policy.plan(budget, context))
            print(f"{name:>15} @ {width:<4} bits: {results[f'{name}@{width}']['median_ms']:7.3f} ms median")
    damage = DamageModel(table).damage(DamageInputs(context.relative_mass, residual))
    baseline = {f"heapq@{w}": timed_ms(lambda: heap_solve(damage, table.nbytes, table.uniform_bytes(w)), 5)
                for w in WIDTHS}
    online = online_ticks(table)
    worst = max(r["median_ms"] for r in results.values())
    print(f"online tick {online['median_ms']:.3f} ms, heapq@4 {baseline['heapq@4']['median_ms']:.3f} ms, "
          f"worst plan {worst:.3f} ms (target {TARGET_MS} ms)")
    return {"model_size": {"name": "Qwen1.5-MoE-A2.7B", "num_layers": 24, "num_experts": 60,
                           "num_blocks": table.num_blocks, "bit_widths": [3, 4, 5, 6, 7, 8]},
            "target_ms": TARGET_MS, "repeats": REPEATS, "static_plans": results, "online_tick": online,
            "baseline_python_heapq": baseline, "worst_static_median_ms": worst,
            "meets_target": worst <= TARGET_MS and online["median_ms"] <= TARGET_MS}


def controllers(num_blocks: int) -> dict:
    """The controllers' costs at one block count (see the module's docstring)."""
    torch.set_num_threads(1)
    layers, experts = SHAPES[num_blocks]
    gen = torch.Generator().manual_seed(0)
    shared = {"gate_up": random_block(64, 32, gen), "down": random_block(32, 32, gen)}
    table = PageTable({BlockId(l, e, m): shared[m] for l in range(layers) for e in range(experts) for m in MODULES},
                      Arena.from_pool(MemoryPool(4 << 30), 256))
    mover = PageMover(table)
    mover.load_all()
    registration = page_table_registration(table.charged_bytes_table(), layers, experts)
    planner = InProcessPlanner("pagedweight")
    planner.register(registration)
    pager = WeightPager(mover, planner, kv_block_bytes=4096)
    blocks = BlockTable([BlockId.parse(k) for k in registration.block_keys], registration.nbytes,
                        registration.sensitivity, layers, experts)
    policy = make_policy("pagedweight", blocks)
    full = int(blocks.nbytes[:, -1].sum())
    out = {"num_blocks": num_blocks, "layers": layers, "experts": experts,
           "planner_solve_ms": timed_ms(lambda: policy.plan(int(0.6 * full), PlanContext()), 5)["median_ms"]}
    pager.step_boundary()
    out["idle_boundary_us"] = round(1e3 * timed_ms(pager.step_boundary, 2001)["median_ms"], 2)
    floor = sum(table.charged_bytes(b, 3) for b in table.entries)
    want = int(0.1 * (table.resident_expert_bytes() - floor) * 0.999)
    out["plan_free_10pct_ms"] = round(1e3 * seconds(lambda: pager.request_bytes(want)), 2)  # once: it changes state
    out["num_lowered_10pct"] = sum(1 for e in table.entries.values() if e.desired_bits < e.committed_bits)
    out["lower_10pct_boundary_ms"] = round(1e3 * seconds(pager.step_boundary), 2)
    mover.close()
    feed = RoutingFeed(layers, experts)
    ids, weights = torch.randint(0, experts, (64, 8)), torch.rand(64, 8)
    for layer in range(layers):
        feed(layer, None, ids, weights)
    out["feed_snapshot_us"] = round(1e3 * timed_ms(feed.snapshot, 201)["median_ms"], 2)
    print(out, flush=True)
    return out


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--controllers", action="store_true", help="the controllers at scale (controller-scale)")
    args = parser.parse_args()
    if args.controllers:
        path = write_result("controller_scale", {"targets": {"plan_ms_at_12288": 10, "idle_boundary_us": 50},
                                                 "shapes": list(SHAPES), "results": [controllers(n) for n in SHAPES]})
    else:
        path = write_result("planner_speed", plans())
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
