"""Planner speed at Qwen1.5-MoE-A2.7B size: 24 layers x 60 experts x 2 blocks = 2880 blocks.

Synthetic sensitivity and routing tables (services/pagedweight/planner/synthetic.py), true APL
bytes. Timed, each as the median (and p90) of repeated runs after a warm-up:
- every policy's static plan at budgets of uniform 3, 3.5, 4 and 5 bits (from scratch:
  every block starts at 8 bits and is lowered to the budget, the most work a plan does);
- the online planner's tick under a changing budget (free / spend / rebalance);
- baseline, same run, same inputs: the textbook heapq greedy in pure Python.
Target: at most 5 ms per plan. Writes bench/results/planner_speed.json.
"""

from __future__ import annotations

import heapq
import statistics
import sys
import time

import numpy as np

from bench.bench_meta import write_result
from pagedweight.planner.damage import DamageInputs, DamageModel
from pagedweight.planner.planner import OnlinePlanner
from pagedweight.planner.policies import POLICY_NAMES, PlanContext, make_policy
from pagedweight.planner.synthetic import QWEN15_MOE_A27B, synthetic_table

TARGET_MS = 5.0
WIDTHS = (3, 3.5, 4, 5)
REPEATS = 40


def timed_ms(fn, repeats: int = REPEATS) -> dict:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"median_ms": round(statistics.median(times), 3),
            "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3)}


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
    rel = table.calib_mass / table.calib_mass.mean(axis=1, keepdims=True)
    inputs = DamageInputs(rel)
    budgets = [table.uniform_bytes(w) for w in (4.0, 4.6)]
    planner.plan(budgets[0], inputs)
    state = {"i": 0}

    def tick():
        state["i"] += 1
        planner.plan(budgets[state["i"] % 2], inputs)

    return timed_ms(tick)


def main() -> int:
    table = synthetic_table(*QWEN15_MOE_A27B, seed=0)
    rng = np.random.default_rng(1)
    residual = rng.normal(0, 0.3, size=table.num_blocks)
    context = PlanContext(table.calib_mass / table.calib_mass.mean(axis=1, keepdims=True), residual)
    results, worst = {}, 0.0
    for name in POLICY_NAMES:
        policy = make_policy(name, table)
        for width in WIDTHS:
            budget = table.uniform_bytes(width)
            if name == "mxmoe":  # solved once per budget by design; time the solve itself
                timing = timed_ms(lambda: make_policy(name, table).plan(budget, context))
            else:
                timing = timed_ms(lambda: policy.plan(budget, context))
            results[f"{name}@{width}"] = timing
            worst = max(worst, timing["median_ms"])
            print(f"{name:>15} @ {width:<4} bits: {timing['median_ms']:7.3f} ms median, {timing['p90_ms']:7.3f} p90")
    damage = DamageModel(table).damage(DamageInputs(context.relative_mass, residual))
    baseline = {f"heapq@{w}": timed_ms(lambda: heap_solve(damage, table.nbytes, table.uniform_bytes(w)), 5)
                for w in WIDTHS}
    for key, timing in baseline.items():
        print(f"{'baseline ' + key:>24}: {timing['median_ms']:7.3f} ms median")
    online = online_ticks(table)
    print(f"online tick (free/spend 0.6 bits): {online['median_ms']:.3f} ms median")
    payload = {
        "model_size": {"name": "Qwen1.5-MoE-A2.7B", "num_layers": 24, "num_experts": 60,
                       "num_blocks": table.num_blocks, "bit_widths": [3, 4, 5, 6, 7, 8]},
        "target_ms": TARGET_MS, "repeats": REPEATS,
        "static_plans": results, "online_tick": online, "baseline_python_heapq": baseline,
        "worst_static_median_ms": worst, "meets_target": worst <= TARGET_MS and online["median_ms"] <= TARGET_MS,
    }
    path = write_result("planner_speed", payload)
    print(f"worst static median {worst:.3f} ms (target {TARGET_MS} ms) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
