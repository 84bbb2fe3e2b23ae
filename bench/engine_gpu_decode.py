"""Engine decode throughput on CUDA: paged APL experts through the fused kernel against
bf16 dense experts, same engine, same load, one run.

For each checkpoint: quantise it (calibration on the GPU, few tokens: speed does not
depend on the calibration), then run the same closed-loop decode load (random prompts,
EOS ignored) through
- `bf16`: the engine over the original checkpoint's dense bf16 experts;
- `apl-B-kernel`: the worker runtime, every block pinned at B bits, fused kernel;
- `apl-8-reference`: the same at 8 bits through the torch dequantising path (what the
  kernel replaces).
Concurrency 1 is batch-1 decode; 16 is a small batch. Writes bench/results/engine_gpu_decode.json.
Run on the GPU machine: PYTHONPATH=.:services:kernels python3 bench/engine_gpu_decode.py --calib FILE ...
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.bench_meta import write_result
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.cli.load_bench import LoadSpec, drive_load
from pagedweight.model import load_model
from pagedweight.runtime import RuntimeConfig, build_runtime

BUDGET = 1 << 30  # ample for the tiny models: this measures speed, not memory pressure


def tokens_per_s(engine, spec: LoadSpec) -> float:
    drive_load(engine, LoadSpec(spec.concurrency, spec.concurrency, spec.prompt_len, 4))  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    load = drive_load(engine, spec)
    assert load.completed == spec.num_requests and load.failed == 0
    return round(load.output_tokens / load.elapsed_s, 1)


def bench_checkpoint(model_dir: Path, calib: list[Path], specs: list[LoadSpec], device: str) -> dict:
    row = {"model": model_dir.name, "loads": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = QuantizeConfig(calib=CalibConfig(max_tokens_per_file=4096), device=device)
        paged = quantize_model(model_dir, Path(tmp) / "paged", calib, config)
        dense = load_model(model_dir, dtype=torch.bfloat16, device=device)
        engines = {"bf16": Engine(dense, config=EngineConfig())}
        runtimes = []
        for name, policy, kernel in (("apl-8-kernel", "static-8", True), ("apl-4-kernel", "static-4", True),
                                     ("apl-3-kernel", "static-3", True), ("apl-8-reference", "static-8", False)):
            runtime = build_runtime(paged, RuntimeConfig(BUDGET, policy, device=device, dtype=torch.bfloat16))
            for moe in runtime.engine.model.moe_blocks:
                moe.experts.use_kernel = kernel
            engines[name] = runtime.engine
            runtimes.append(runtime)
        for spec in specs:
            result = {"concurrency": spec.concurrency, "requests": spec.num_requests,
                      "prompt_len": spec.prompt_len, "max_tokens": spec.max_tokens}
            for name, engine in engines.items():
                result[f"{name}_tokens_per_s"] = tokens_per_s(engine, spec)
            result["kernel_4bit_vs_bf16"] = round(result["apl-4-kernel_tokens_per_s"] / result["bf16_tokens_per_s"], 2)
            print(model_dir.name, result, flush=True)
            row["loads"].append(result)
        for runtime in runtimes:
            runtime.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", type=Path, required=True, help="checkpoint directories")
    parser.add_argument("--calib", nargs="+", type=Path, required=True, help="calibration text files")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to check the script)")
    args = parser.parse_args()
    specs = [LoadSpec(4, 1, 32, args.max_tokens), LoadSpec(32, 16, 32, args.max_tokens)]
    rows = [bench_checkpoint(m, args.calib, specs, args.device) for m in args.models]
    print(write_result("engine_gpu_decode", {"dtype": "bfloat16", "results": rows}))


if __name__ == "__main__":
    main()
