"""Paged decode attention at long contexts: the batched path (gathers every sequence's
blocks into a padded copy, then SDPA) against the in-place path (Triton kernel reading the
tiles where they are), one layer of Qwen1.5-MoE-A2.7B's attention shape (16 kv heads of
128, bf16, 16-token blocks scattered over the cache), against the copy bandwidth measured
in the same run (issue 12, point 3).

Floor = the KV bytes one decode step must read (every cached token's K and V of the
layer, once) over the copy bandwidth. Times: CUDA events, median of --repeats.

    PYTHONPATH=.:services:kernels python3 -m bench.paged_decode_attention
    .venv/bin/python -m bench.paged_decode_attention --device cpu --contexts 256 --batches 1 2   # checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.bench_meta import RESULTS_DIR, commit, machine
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig, PagedKVCache
from pagedweight.model.paged_attention import SeqSlice, build_step, paged_attention
from pagedweight_kernels.paged_decode import paged_decode_triton

QWEN_ATTENTION = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=151936,
                      hidden_size=2048, intermediate_size=5632, num_hidden_layers=1, num_attention_heads=16,
                      num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, max_position_embeddings=32768,
                      rope_theta=1e6, rms_norm_eps=1e-6)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() (events on CUDA, after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = ModelConfig.from_dict(QWEN_ATTENTION)
    G, N, D, bs = config.num_kv_heads, config.num_heads, config.head_dim, 16
    out = args.out or RESULTS_DIR / f"paged_decode_attention_{device.type}.json"
    record = {"benchmark": "paged_decode_attention", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "dtype": str(dtype), "block_size": bs,
              "kv_heads": G, "heads": N, "head_dim": D, "rows": []}
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    record["copy_bandwidth_bytes_per_s"] = bw
    gen = torch.Generator().manual_seed(0)
    cases = [(b, c) for b in args.batches for c in args.contexts]
    for i, (B, ctx) in enumerate(cases):
        blocks_per_seq = -(-ctx // bs)
        num_blocks = B * blocks_per_seq + 1
        kv = PagedKVCache(config, KVCacheConfig(block_size=bs), dtype, device, num_blocks=num_blocks)
        kv.flat.normal_()
        perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
        seqs = [SeqSlice(perm[b * blocks_per_seq:(b + 1) * blocks_per_seq], ctx, 1) for b in range(B)]
        q = torch.randn(B, N, D, device=device, dtype=dtype)
        k_new, v_new = (torch.randn(B, G, D, device=device, dtype=dtype) for _ in range(2))
        row = {"batch": B, "context": ctx}
        results = {}
        for impl in ("batched", "inplace"):
            step = build_step(kv, seqs, impl)
            results[impl] = paged_attention(0, q, k_new, v_new, step)
            row[f"{impl}_ms"] = round(1000 * timed(lambda: paged_attention(0, q, k_new, v_new, step),
                                                   device, args.repeats), 4)
        if device.type == "cuda":  # the kernel alone, by tiles read per loop iteration
            step = build_step(kv, seqs, "inplace")
            k_off, v_off = kv.kv_tile_offsets(0, step.block_table)
            for tiles in (1, 4):
                row[f"kernel_tiles{tiles}_ms"] = round(1000 * timed(lambda: paged_decode_triton(
                    q, kv.flat, k_off, v_off, step.seq_context_lens, bs, G, block_table=step.block_table,
                    tiles_per_iter=tiles), device, args.repeats), 4)
        kv_bytes = 2 * B * ctx * G * D * kv.flat.element_size()
        row["kv_bytes"] = kv_bytes
        row["floor_ms"] = round(1000 * kv_bytes / bw, 4)
        row["inplace_speedup"] = round(row["batched_ms"] / row["inplace_ms"], 2)
        row["inplace_of_floor"] = round(row["floor_ms"] / row["inplace_ms"], 3)
        ref = results["batched"].float()
        row["rel_diff"] = float((results["inplace"].float() - ref).norm() / ref.norm())
        record["rows"].append(row)
        print(f"[{i + 1}/{len(cases)}] {json.dumps(row)}", file=sys.stderr, flush=True)
        del kv
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("batch context batched_ms inplace_ms floor_ms speedup of_floor kernel_tiles1_ms kernel_tiles4_ms")
    for r in record["rows"]:
        print(r["batch"], r["context"], r["batched_ms"], r["inplace_ms"], r["floor_ms"], r["inplace_speedup"],
              r["inplace_of_floor"], r.get("kernel_tiles1_ms"), r.get("kernel_tiles4_ms"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
