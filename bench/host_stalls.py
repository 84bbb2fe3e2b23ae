"""Host-side candidates for the ~0.3 s step after a lowering (docs/elasticity.md 2h), timed
on the CPU, where they run as they do beside the H200 (pure Python):

1. KV growth into the holes a lowering leaves: the arena at Qwen1.5-MoE's 12-layer sizes
   (1440 blocks loaded at 8 bits, planes then LUT, bottom first; 1 GB of KV room), 128 KV
   blocks grown, 395 random blocks lowered (to 3-6 bits, as 2h's plan: 395 blocks, mean 7.21),
   then KV grown 133 blocks a step (PagedKVCache.grow's calls: num_fitting, the pool's check,
   one arena allocation per layer tile, highest first) - host seconds per step.
2. A full collection of Python's garbage collector in a process holding a pagedweight
   runtime (`--gc-shape`, bench/real_shape.py's random model, CPU): seconds, before and after
   `gc.freeze()`.

    PYTHONPATH=.:services:kernels .venv/bin/python -m bench.host_stalls
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from bench.bench_meta import RESULTS_DIR, commit, machine
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_FREE, MemoryPool, expert_kind

LAYERS, EXPERTS = 12, 60
GATE_UP, DOWN = (2816, 2048), (2048, 1408)  # rows, cols of Qwen1.5-MoE's expert blocks
KV_TILE = 2 * 16 * 16 * 128 * 2  # one layer's K and V of a 16-token block, bf16


def _plane(rc):
    return rc[0] * rc[1] // 8


def _lut(rc, bits):
    return rc[0] * (1 << bits) * 2


def kv_growth_after_lowering(seed: int = 0, steps: int = 9, per_step: int = 133) -> dict:
    rng = random.Random(seed)
    shapes = [m for _ in range(LAYERS * EXPERTS) for m in (GATE_UP, DOWN)]
    experts8 = sum(8 * _plane(m) + _lut(m, 8) for m in shapes)
    pool = MemoryPool(experts8 + 640 * LAYERS * KV_TILE + (64 << 20))
    arena = Arena.from_pool(pool)
    held = []
    for m in shapes:
        planes = [arena.allocate(expert_kind(8), _plane(m)) for _ in range(8)]
        held.append((m, planes, arena.allocate(expert_kind(8), _lut(m, 8))))
    kv = []

    def grow(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            if not (arena.num_fitting(KV_TILE) >= LAYERS
                    and pool.can_allocate(KV_FREE, LAYERS * arena.charged_bytes(KV_TILE))):
                break
            kv.append([arena.allocate(KV_FREE, KV_TILE) for _ in range(LAYERS)])
        return time.perf_counter() - start

    before = grow(128)
    start = time.perf_counter()
    for i in rng.sample(range(len(held)), 395):
        m, planes, lut = held[i]
        bits = rng.choice((3, 4, 5, 5, 6))
        for x in planes[bits:] + [lut]:
            arena.free(x)
        held[i] = (m, planes[:bits], arena.allocate(expert_kind(bits), _lut(m, bits)))
    lowering = time.perf_counter() - start
    rows = []
    for _ in range(steps):
        n = len(kv)
        seconds = grow(per_step)
        rows.append({"blocks_grown": len(kv) - n, "kv_blocks": len(kv), "host_s": round(seconds, 4),
                     "free_runs": len(arena._free_len)})
    return {"grow_128_before_lowering_s": round(before, 4), "lowering_395_blocks_s": round(lowering, 4),
            "steps": rows}


def full_collection(shape: str) -> dict:
    import torch

    from bench import elasticity

    args = argparse.Namespace(artifact=None, shape=shape, layers=None, concurrency=32, prompt_len=128,
                              max_tokens=32, kv_fraction=0.5, calm_steps=16, calm_seconds=0.5, offer_min_blocks=4,
                              ask_ahead_blocks=8, offer_min_used_fraction=0.25, no_project_demand=False,
                              no_ask_before_short=False, batched_tokens=1024, graphs_per_bucket=1)
    torch.set_num_threads(2)
    paged, config, eos, _ = elasticity.load_model(args, torch.device("cpu"), torch.float32)
    ecfg = elasticity.engine_config(args)
    sizes = elasticity.budget_bytes(paged, config, ecfg, torch.float32, args)
    runtime = elasticity.build_runtime_from_paged(
        paged, elasticity.RuntimeConfig(sizes["budget"], "pagedweight", device="cpu", dtype=torch.float32,
                                        engine=ecfg), eos)
    try:
        tracked = len(gc.get_objects())
        start = time.perf_counter()
        gc.collect()
        cold = time.perf_counter() - start
        gc.freeze()
        start = time.perf_counter()
        gc.collect()
        frozen = time.perf_counter() - start
    finally:
        gc.unfreeze()
        runtime.close()
    return {"shape": shape, "tracked_objects": tracked, "full_collection_s": round(cold, 4),
            "full_collection_after_freeze_s": round(frozen, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gc-shape", default="qwen-scaled", help="'' skips the collector's measurement")
    parser.add_argument("--out", default=str(RESULTS_DIR / "host_stalls.json"))
    args = parser.parse_args()
    result = {"benchmark": "host_stalls", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "kv_growth_after_lowering": kv_growth_after_lowering()}
    if args.gc_shape:
        result["garbage_collector"] = full_collection(args.gc_shape)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
