"""The routed dense experts of one MoE layer at few tokens: the expert GEMV
(`decode_ops.experts_gemv`, two launches) against the grouped path it replaces at small
batches (`decode_ops.grouped_moe_fused`: group_rows, two torch._grouped_mm, gated_rows,
combine_rows), bf16, at Qwen1.5-MoE-A2.7B's and Mixtral-8x7B's expert shapes, per token
count; against the copy bandwidth of the same run. It picks
`decode_ops.GEMV_MAX_TOKENS_PER_EXPERT`: the most assignments per expert (T k / E) up to
which the GEMV is the faster at every shape.

Each timed replay is a CUDA graph over L layers (their own weights and routing, several GB
together: no layer's experts stay in L2 from the last replay); time per layer = replay
median / L. Bytes per layer = the experts the routing touches (counted) x their bytes.

    PYTHONPATH=.:services:kernels python3 -m bench.expert_gemv --out $OUT/expert_gemv.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.bench_meta import RESULTS_DIR, commit, machine
from pagedweight_kernels import decode_ops

SHAPES = {  # experts, top-k, hidden, expert intermediate; layers per replay
    "qwen1.5-moe-a2.7b": dict(E=60, k=4, H=2048, I=1408, layers=4),
    "mixtral-8x7b": dict(E=8, k=2, H=4096, I=14336, layers=2),
}


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second, timed eagerly (a copy captured
    in a graph becomes a memcpy node on the copy engines: 2.7 TB/s where the kernel copy that
    real_shape.py times gives 4.2, the first run of this script, 2026-12-01)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def replay_seconds(fn, repeats: int = 20) -> float:
    """Median seconds of one replay of fn captured as a CUDA graph (warmed up first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def routing(T: int, E: int, k: int, gen: torch.Generator):
    """Uniform top-k routing: k distinct experts per token, weights summing to 1."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids.cuda(), (w / w.sum(-1, keepdim=True)).to(torch.bfloat16).cuda()


def measure(name: str, shape: dict, tokens: list[int], bw: float) -> list[dict]:
    E, k, H, I, L = shape["E"], shape["k"], shape["H"], shape["I"], shape["layers"]
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(L):  # random weights filled on the device (no host copy of GBs)
        gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda").normal_(0, H ** -0.5)
        down = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda").normal_(0, I ** -0.5)
        layers.append((gate_up, down))
    expert_bytes = 2 * (2 * I * H + H * I)
    rows = []
    for T in tokens:
        inputs = [(torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda(), *routing(T, E, k, gen))
                  for _ in range(L)]
        touched = sum(len(set(ids.flatten().tolist())) for _, ids, _ in inputs) / L
        row = {"tokens": T, "experts_touched_per_layer": touched, "bytes_per_layer": touched * expert_bytes}
        outs = {}
        variants = {"grouped": decode_ops.grouped_moe_fused}
        if T * k <= decode_ops.MAX_GEMV_ASSIGN:  # the kernels' limit (the model's: GEMV_MAX_TOKENS_PER_EXPERT)
            variants["gemv"] = decode_ops.experts_gemv
        for variant, op in variants.items():
            def run(op=op, variant=variant):
                outs[variant] = [op(x, ids, w, gu, d) for (x, ids, w), (gu, d) in zip(inputs, layers)]
            s = replay_seconds(run) / L
            row[f"{variant}_us"] = round(1e6 * s, 2)
            row[f"{variant}_bandwidth_fraction"] = round(row["bytes_per_layer"] / s / bw, 3)
        if "gemv" in outs:
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                      for a, b in zip(outs["gemv"], outs["grouped"]))
            row["gemv_vs_grouped_rel_err"] = err
            row["speedup"] = round(row["grouped_us"] / row["gemv_us"], 3)
        print(f"{name} T={T}: {json.dumps(row)}", flush=True)
        rows.append(row)
    del layers
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    parser.add_argument("--mixtral-tokens", type=int, nargs="*", default=None,
                        help="token counts of the Mixtral shape (default: --tokens)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "expert_gemv_cuda.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    result = {"benchmark": "expert_gemv", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "copy_bandwidth_bytes_per_s": bw,
              "kernel": {"rows_per_pass": decode_ops.GEMV_ROWS, "unroll": decode_ops.GEMV_UNROLL,
                         "max_tokens_per_expert_in_code": decode_ops.GEMV_MAX_TOKENS_PER_EXPERT}, "models": {}}
    for name in args.models:
        tokens = args.mixtral_tokens if name == "mixtral-8x7b" and args.mixtral_tokens is not None else args.tokens
        rows = measure(name, SHAPES[name], tokens, bw)
        faster = [r["tokens"] for r in rows if r.get("speedup", 0) > 1]
        crossover = max((t for t in faster if all(t2 in faster for t2 in tokens if t2 <= t)), default=0)
        per_expert = round(crossover * SHAPES[name]["k"] / SHAPES[name]["E"], 3)
        result["models"][name] = {"shape": SHAPES[name], "rows": rows, "gemv_faster_up_to_tokens": crossover,
                                  "gemv_faster_up_to_tokens_per_expert": per_expert}
        result["gemv_faster_up_to_tokens_per_expert"] = min(
            m["gemv_faster_up_to_tokens_per_expert"] for m in result["models"].values())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, m in result["models"].items():
        print(f"{name}: GEMV faster up to {m['gemv_faster_up_to_tokens']} tokens")
        for r in m["rows"]:
            print(f"  T={r['tokens']:3d} touched {r['experts_touched_per_layer']:5.1f}  grouped {r['grouped_us']:8.1f} us "
                  f"({r['grouped_bandwidth_fraction']:.2f} bw)  gemv {r.get('gemv_us', float('nan')):8.1f} us "
                  f"({r.get('gemv_bandwidth_fraction', float('nan')):.2f} bw)  x{r.get('speedup', float('nan'))}")


if __name__ == "__main__":
    main()
