"""Batch-1 greedy decode tokens/s of the tiny models on the GPU: bf16 experts against the
fused APL kernel (APLExperts, mixed 3..8-bit blocks), same run, same prompt.

The reference decode loop (services/pagedweight/engine/generate.py), eager (no CUDA graphs), so
per-token host work counts for both. Writes bench/results/apl_moe_tiny_decode.json.

Usage on the GPU machine: PYTHONPATH=.:services:kernels python3 bench/apl_moe_tiny_decode.py [model dirs...]
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.bench_meta import write_result
from pagedweight_kernels.synthetic import quantize_experts
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.model import load_model
from pagedweight_kernels.resident_experts import APLExperts
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight_kernels.synthetic import mixed_bits

NEW_TOKENS, RUNS = 64, 3


def tokens_per_s(model, tokenizer, prompt_ids) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    generate(model, prompt_ids, params)  # warm-up (compiles kernels)
    times = []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, prompt_ids, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return NEW_TOKENS / statistics.median(times)


def main():
    dirs = [Path(d) for d in sys.argv[1:]] or [Path("models/micro-mixtral")]
    device = torch.device("cuda")
    rows = []
    for model_dir in dirs:
        model = load_model(model_dir, dtype=torch.bfloat16, device=device)
        tokenizer = Tokenizer(model_dir)
        prompt_ids = tokenizer.encode("In the beginning God created the heaven and the earth. " * 3)
        dense = tokens_per_s(model, tokenizer, prompt_ids)
        for block in model.moe_blocks:
            gate_up, down = quantize_experts(block.experts.gate_up, block.experts.down)
            block.experts = APLExperts.from_blocks(gate_up, down, mixed_bits(len(gate_up)), device, use_kernel=True)
        fused = tokens_per_s(model, tokenizer, prompt_ids)
        rows.append({"model": model_dir.name, "prompt_tokens": len(prompt_ids), "new_tokens": NEW_TOKENS,
                     "bf16_tokens_per_s": dense, "apl_kernel_tokens_per_s": fused, "speedup": fused / dense})
        print(f"{model_dir.name:16s} bf16 {dense:7.1f} tok/s   APL kernel (mixed bits) {fused:7.1f} tok/s", flush=True)
    path = write_result("apl_moe_tiny_decode", {"runs": RUNS, "results": rows})
    if os.environ.get("PAGEDWEIGHT_COMMIT"):
        record = json.loads(path.read_text())
        record["commit"] = os.environ["PAGEDWEIGHT_COMMIT"]
        path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
