"""Controller cost at large expert-block counts: planner, pager, page table, routing feed.

Shapes: Qwen1.5-MoE-A2.7B (24 x 60 x 2 = 2,880 blocks), Qwen3-30B-A3B (48 layers x 128
experts x 2 = 12,288) and a DeepSeek-class 30,000 (60 x 250 x 2). Blocks are tiny and share
their host tensors (the point is the controllers' work per block, not copy bandwidth or
host memory). Per shape, on the CPU:

- plan: the planner alone (the `pagedweight` policy's static solve over a BlockTable) and a
  pager round trip (`request_bytes` -> PlanRequest -> in-process planner -> applied plan);
- step boundary: idle (settled), and when 1%, 10% and 100% of the blocks lower at once
  (the compaction that makes freed pages usable as KV is timed with it);
- routing feed: one snapshot of the [L, E] window;
- memory: Python-side bytes of the page table and pager once loaded (tracemalloc; tensor
  storage is not counted: it is the arena and the host copies, sized by the format).

Baseline in the same run: the same measurements on another git ref's code (default `main`),
extracted with `git archive` and run in a subprocess. Targets: a plan within
10 ms at 12,288 blocks, an idle step boundary within 50 us.

    python bench/controller_scale.py [--baseline-ref main] [--shapes 2880,12288,30000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {2880: (24, 60), 12288: (48, 128), 30000: (60, 250)}  # blocks -> (layers, experts)
HIDDEN, INTERMEDIATE, PAGE, KV_BLOCK = 32, 32, 256, 4096


def best_of(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls (fn re-arms its own state)."""
    times = []
    for _ in range(repeat):
        times.append(fn())
    return statistics.median(times)


def measure(num_blocks: int) -> dict:
    """Everything for one shape, on the code importable as `pagedweight` in this process."""
    import torch

    from pagedweight.format.blocks import MODULES, BlockId
    from pagedweight.memory.arena import Arena
    from pagedweight.memory.pool import MemoryPool
    from pagedweight.planner.policies import PlanContext, make_policy
    from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
    from pagedweight.weights.page_mover import PageMover
    from pagedweight.weights.page_table import PageTable
    from pagedweight.weights.synthetic import random_block
    from pagedweight.weights.weight_pager import WeightPager
    from pagedweight.planner.tables import BlockTable

    torch.set_num_threads(1)
    layers, experts = SHAPES[num_blocks]
    gen = torch.Generator().manual_seed(0)
    shared = {"gate_up": random_block(2 * INTERMEDIATE, HIDDEN, gen), "down": random_block(HIDDEN, INTERMEDIATE, gen)}
    blocks = {BlockId(l, e, m): shared[m] for l in range(layers) for e in range(experts) for m in MODULES}
    out = {"num_blocks": len(blocks), "layers": layers, "experts": experts}

    # ---- the planner alone ---------------------------------------------------------------
    pool = MemoryPool(4 << 30)
    arena = Arena.from_pool(pool, PAGE)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    registration = page_table_registration(table.charged_bytes_table(), layers, experts)
    planner = InProcessPlanner("pagedweight")
    planner.register(registration)
    pager = WeightPager(mover, planner, kv_block_bytes=KV_BLOCK)
    out["table_python_bytes"] = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    out["table_python_bytes_per_block"] = round(out["table_python_bytes"] / len(blocks))

    bt = BlockTable([BlockId.parse(k) for k in registration.block_keys], registration.nbytes,
                    registration.sensitivity, layers, experts)
    policy = make_policy("pagedweight", bt)
    full = int(bt.nbytes[:, -1].sum())
    out["planner_solve_ms"] = 1e3 * best_of(lambda: _timed(lambda: policy.plan(int(0.6 * full), PlanContext())), 5)

    # ---- step boundaries and pager round trips -------------------------------------------
    def idle():
        return _timed(pager.step_boundary)
    pager.step_boundary()
    out["idle_boundary_us"] = 1e6 * best_of(idle, 2001)
    out["offer_refused_us"] = 1e6 * best_of(lambda: _timed(lambda: pager.offer_bytes(0)), 1001)

    resident = table.resident_expert_bytes()
    for share in (0.01, 0.1, 1.0):
        # free `share` of the bytes that lowering every block to 3 bits would free
        floor = sum(table.charged_bytes(b, 3) for b in table.entries)
        want = int(share * (resident - floor) * 0.999)
        request_ms = 1e3 * _timed(lambda: pager.request_bytes(want))
        changed = sum(1 for e in table.entries.values() if e.desired_bits < e.committed_bits)
        boundary_ms = 1e3 * _timed(pager.step_boundary)
        tag = f"{int(share * 100)}pct"
        out[f"plan_free_{tag}_ms"] = round(request_ms, 2)
        out[f"lower_{tag}_boundary_ms"] = round(boundary_ms, 2)
        out[f"num_lowered_{tag}"] = changed
        pager.step_boundary()
        out[f"idle_after_{tag}_boundary_us"] = round(1e6 * best_of(idle, 501), 2)
        # back to 8 bits for the next share (not timed)
        for e in table.entries.values():
            e.desired_bits = 8
        table.num_desired_updates += 1
        mover.load_all()
        pager = WeightPager(mover, planner, kv_block_bytes=KV_BLOCK)
        pager.step_boundary()
    mover.close()
    out |= measure_routing_feed(layers, experts)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def measure_routing_feed(layers: int, experts: int) -> dict:
    """The routing feed's cost per observed layer and per snapshot, in microseconds."""
    import torch

    from pagedweight.weights.routing_feed import RoutingFeed

    feed = RoutingFeed(layers, experts)
    ids = torch.randint(0, experts, (64, 8))
    weights = torch.rand(64, 8)
    for layer in range(layers):
        feed(layer, None, ids, weights)
    return {"feed_observe_us": 1e6 * best_of(lambda: _timed(lambda: feed(0, None, ids, weights)), 201),
            "feed_snapshot_us": 1e6 * best_of(lambda: _timed(feed.snapshot), 201)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_tree(services: Path, kernels: Path, shapes: list[int]) -> list[dict]:
    """`measure` for each shape in a fresh process on the code under `services`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(services), str(kernels)]))
    results = []
    for n in shapes:
        proc = subprocess.run([sys.executable, __file__, "--measure", str(n)], env=env, capture_output=True,
                              text=True, check=False)
        if proc.returncode:
            results.append({"num_blocks": n, "error": proc.stderr.strip().splitlines()[-1:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-ref", default="main", help="git ref measured as the baseline ('' for none)")
    parser.add_argument("--shapes", default="2880,12288,30000")
    parser.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure)))
        return
    shapes = [int(s) for s in args.shapes.split(",")]
    result = {"targets": {"plan_ms_at_12288": 10, "idle_boundary_us": 50}, "shapes": shapes}
    if args.baseline_ref:
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "archive", args.baseline_ref, "services", "kernels"], cwd=REPO,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sha = subprocess.run(["git", "rev-parse", args.baseline_ref], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.strip()
            result["baseline"] = {"ref": args.baseline_ref, "commit": sha,
                                  "results": run_tree(Path(tmp) / "services", Path(tmp) / "kernels", shapes)}
    result["results"] = run_tree(REPO / "services", REPO / "kernels", shapes)
    sys.path.insert(0, str(REPO))
    from bench.bench_meta import write_result

    print(write_result("controller_scale", result))


if __name__ == "__main__":
    main()
