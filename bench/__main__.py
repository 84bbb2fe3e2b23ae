"""The benchmarks' runner: `python -m bench list`, `run NAME [--dry-run] [-- EXTRA...]`, `tables`.

A recipe (RECIPES) is a benchmark module and the arguments of one documented run: the one place
a device call's arguments live. Arguments after `--` are appended, so they override the recipe's;
`{artifacts}` is the folder of paged models (`--artifacts`, default $PAGEDWEIGHT_ARTIFACTS). A
recipe runs `python -m bench.<module>` in a child process with services/ and kernels/ on the
import path, so a copy of the tree without a virtual environment runs it; such a copy names its
commit in $PAGEDWEIGHT_COMMIT.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Recipe:
    name: str
    module: str           # bench.<module>
    args: str             # its arguments, as a shell would split them
    device: str           # "cpu" or "gpu": where the recorded result was measured
    what: str             # one line: what the run measures (docs/benchmarks.md lists them)


WIDTHS = "--bits 3 4 5 6 7 8 mixed"  # the kernel benchmark's bit configurations
# The trace sweeps' shared arguments (Qwen1.5-MoE at full depth, 60 s of arrivals, 3 budgets).
TRACE_SWEEP = ("--shape qwen1.5-moe-a2.7b --device cuda --duration-s 60 --num-budgets 3 --rows pagedweight static-4 "
               "--time-limit-s 400")

RECIPES = (
    # --- CPU: runs on a laptop in minutes ---------------------------------------------------
    Recipe("decode-speed", "decode_speed", "", "cpu",
           "batch-1 decode of the bundled models against transformers, same CPU, same run"),
    Recipe("planner-speed", "planner_speed", "", "cpu",
           "every planner policy's plan at Qwen1.5-MoE size (2,880 blocks) against a heapq greedy"),
    Recipe("controller-scale", "planner_speed", "--controllers", "cpu",
           "planner, pager, page table and routing feed at 2,880 / 12,288 / 30,000 blocks"),
    Recipe("quality-budget", "quality_budget", "--artifacts {artifacts}", "cpu",
           "KL to bf16 and perplexity of every policy at 3.0-6.0 mean plane bits, with 95% CIs"),
    Recipe("calibration-quality", "calibration_quality",
           "--artifacts {artifacts}/calibration --models micro-mixtral tiny-mixtral tiny-qwen-moe", "cpu",
           "prompt residuals under domain shift; calibration tokens and domains against held-out quality"),
    Recipe("serve-load", "serve_load", "--model {artifacts}/micro-mixtral", "cpu",
           "the gRPC/HTTP cluster under a Poisson trace against the in-process engine"),
    Recipe("budget-sweep-cpu", "budget_sweep",
           "--artifact {artifacts}/tiny-qwen-moe --device cpu --requests 8 --concurrency 4 --prompt-len 64 "
           "--max-tokens 8 --batched-tokens 512 --kl --kl-windows 2 --num-budgets 4 --row-time-limit-s 60", "cpu",
           "bf16 in the same memory, every static width, the fitting uniform width and pagedweight at 4 "
           "budgets, with KL to bf16 of what each served (trained tiny Qwen-MoE)"),
    Recipe("retrieval-budget", "retrieval_budget", "--work {artifacts}/retrieval-budget", "cpu",
           "retrieval exact match at 2k-8k tokens: bf16 unlimited and in the budget, the elastic policy and "
           "the fitting uniform width, at two budgets, with 95% intervals"),
    Recipe("real-shape-cpu", "real_shape", "--model tiny-qwen-moe --device cpu", "cpu",
           "the real-shape benchmark on a tiny model (checks the benchmark)"),
    Recipe("kernel-sass", "sass_mix", "'apl_gemv<1, 0, true, true, 1>'", "cpu",
           "instructions per weight in the 5-8-bit decode kernel's step loop, from its SASS (nvcc, no GPU)"),
    # --- GPU: one device call each (at most 10 minutes) ---------------------------------------
    # c1-c256, bf16 against static 4 and 8 bits, each with its per-component step profile
    Recipe("real-shape-qwen", "real_shape",
           "--model qwen1.5-moe-a2.7b --modes graphs-inplace graphs-overlap --concurrency 1 16 64 256 "
           "--profile-concurrency 1 64 --time-limit-s 540",
           "gpu", "Qwen1.5-MoE-A2.7B serving: transformers, bf16, static bits, pressure, HBM floor"),
    # 93 GB in bf16: quantised layer by layer (--build auto), the bf16 rows "does not fit"
    Recipe("real-shape-mixtral", "real_shape",
           "--model mixtral-8x7b --modes graphs-inplace --concurrency 1 16 64 --static-bits 4 8 --kv-gib 4 "
           "--ttft-prompts 512 --profile-concurrency 1 --component-concurrency 1 64 --skip hf pressure "
           "--time-limit-s 540",
           "gpu", "Mixtral-8x7B at 4 and 8 bits (built layer by layer) against its HBM floor"),
    Recipe("real-shape-qwen3", "real_shape", "--model qwen3-30b-a3b --time-limit-s 540", "gpu",
           "Qwen3-30B-A3B serving at its published shape"),
    Recipe("real-shape-olmoe", "real_shape", "--model olmoe-1b-7b --time-limit-s 540", "gpu",
           "OLMoE-1B-7B serving at its published shape"),
    Recipe("real-shape-gemma4", "real_shape",
           "--model gemma-4-26b-a4b --modes graphs-inplace --concurrency 1 16 64 256 --hf-concurrency 1 16 64 "
           "--static-bits 4 8 --ttft-prompts 512 --profile-concurrency 1 64 --skip pressure --time-limit-s 540",
           "gpu", "Gemma-4-26B-A4B serving at its published shape: transformers, bf16, static 4 and 8 bits"),
    Recipe("budget-sweep-cpu-bursty", "budget_sweep",
           "--artifact {artifacts}/tiny-qwen-moe --device cpu --trace bursty --duration-s 8 --rate 3 --concurrency 4 "
           "--prompt-len 64 --max-tokens 8 --batched-tokens 512 --num-budgets 2 --rows static-8 pagedweight", "cpu",
           "a bursty 8 s trace at the two ends of the sweep: what the pager moves (trained tiny Qwen-MoE)"),
    Recipe("budget-sweep-qwen-a", "budget_sweep",
           "--shape qwen1.5-moe-a2.7b --device cuda --num-budgets 4 --rows bf16 static-8 static-7 static-6 "
           "fitting-uniform --name budget_sweep_qwen1.5-moe-a2.7b_a --time-limit-s 450",
           "gpu", "Qwen1.5-MoE, 24 layers, 4 budgets: bf16 in the same memory and static 8/7/6 bits"),
    Recipe("budget-sweep-qwen-b", "budget_sweep",
           "--shape qwen1.5-moe-a2.7b --device cuda --num-budgets 4 --rows pagedweight static-5 static-4 static-3 "
           "fitting-uniform --name budget_sweep_qwen1.5-moe-a2.7b_b --time-limit-s 450",
           "gpu", "Qwen1.5-MoE, 24 layers, the same 4 budgets: pagedweight and static 5/4/3 bits"),
    # traces like traffic, 60 s each: the budgets where the width must move, pagedweight beside static 4 bits
    Recipe("budget-sweep-qwen-steady", "budget_sweep", f"{TRACE_SWEEP} --trace steady --rate 8", "gpu",
           "Qwen1.5-MoE, 24 layers, 60 s of Poisson arrivals at 3 budgets: pagedweight and static 4 bits"),
    Recipe("budget-sweep-qwen-bursty", "budget_sweep", f"{TRACE_SWEEP} --trace bursty --rate 8", "gpu",
           "Qwen1.5-MoE, 24 layers, 60 s of bursts (3x the mean rate 5 s in 20) at 3 budgets: pagedweight and static 4"),
    Recipe("budget-sweep-qwen-long-context", "budget_sweep",
           f"{TRACE_SWEEP} --trace long-context --rate 0.5 --concurrency 8 --long-prompts 4096 7936", "gpu",
           "Qwen1.5-MoE, 24 layers, 60 s of 4k-8k-token prompts at 3 budgets: pagedweight and static 4 bits"),
    Recipe("kernel-layer-qwen", "apl_moe_kernel", f"--models qwen1.5-moe-a2.7b {WIDTHS} --name apl_moe_kernel_qwen",
           "gpu", "one Qwen1.5-MoE MoE layer at 1-256 tokens, widths 3..8 and mixed, against bf16 grouped GEMM"),
    Recipe("kernel-layer-mixtral", "apl_moe_kernel", f"--models mixtral-8x7b {WIDTHS} --name apl_moe_kernel_mixtral",
           "gpu", "one Mixtral-8x7B MoE layer at 1-256 tokens, widths 3..8 and mixed, against bf16 grouped GEMM"),
    Recipe("kernel-layer-gemma4", "apl_moe_kernel", f"--models gemma-4-26b-a4b {WIDTHS} --name apl_moe_kernel_gemma4",
           "gpu", "one Gemma-4-26B-A4B MoE layer at 1-256 tokens, widths 3..8 and mixed, against bf16 grouped GEMM"),
    # the gateway's packages on a GPU image: tools/serve_sweep_gpu.sh installs them from carried wheels
    Recipe("serve-sweep", "serve_load",
           "--mode sweep --model {artifacts}/micro-mixtral --device cuda --memory-budget 0.85 --concurrency 16,64,256 "
           "--duration 30 --prompt-len 32:128 --output-len 128:256 --threads 4",
           "gpu", "in-process engine, worker gRPC and gateway HTTP side by side at c16, c64, c256"),
    # 4 Qwen1.5-MoE-size layers hold 2.74 GB of 8-bit experts: the budget must hold them
    Recipe("pool-split", "pool_split_gpu", "--budget 3GiB --cycles 2", "gpu",
           "reserved device memory against the budget while the weights/KV split moves"),
    Recipe("quantize-stream-mixtral", "quantize_stream",
           "--model Mixtral-8x7B --layers 2 --name quantize_mixtral_2layer", "gpu",
           "streaming quantisation at Mixtral-8x7B shape, 2 layers: time and peak memory"),
    Recipe("quantize-full-depth", "quantize_stream",
           "--model Qwen1.5-MoE-A2.7B --calib-tokens 2048 --name quantize_full_depth_qwen",
           "gpu", "streaming quantisation of the whole Qwen1.5-MoE-A2.7B shape within one call"),
)

BY_NAME = {r.name: r for r in RECIPES}


def command(recipe: Recipe, artifacts: str, extra: list[str]) -> list[str]:
    args = [a.replace("{artifacts}", artifacts) for a in shlex.split(recipe.args)]
    return [sys.executable, "-m", f"bench.{recipe.module}", *args, *extra]


def child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(REPO), str(REPO / "services"), str(REPO / "kernels")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def full_depth_staging(cmd: list[str]) -> tuple[list[str], list[Path]]:
    """quantize-full-depth: the checkpoint (28.6 GB) is built first, in its own process so the
    quantiser's peak memory is its own, into /dev/shm with the work directory, since a
    64 GB device disk cannot hold checkpoint, work directory (~24 GB) and artifact (~23 GB).
    Returns the quantising command and the folders to remove after it."""
    shm = Path("/dev/shm/pagedweight-full-depth")
    shutil.rmtree(shm, ignore_errors=True)
    subprocess.run([*cmd, "--checkpoint", str(shm / "ckpt"), "--build-only"], cwd=REPO, env=child_env(), check=True)
    disk = Path(os.environ.get("TMPDIR", "/tmp")) / "pagedweight-full-depth"
    artifact = disk if shutil.disk_usage(disk.parent).free > 35e9 else shm / "art"
    run = [*cmd, "--checkpoint", str(shm / "ckpt"), "--work", str(artifact), "--work-dir", str(shm / "work")]
    return run, [shm, disk]


def list_recipes() -> None:
    width = max(len(r.name) for r in RECIPES)
    for r in RECIPES:
        print(f"{r.name:<{width}}  {r.device}  {r.what}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="the recipes")
    run = sub.add_parser("run", help="run one recipe")
    run.add_argument("recipe", choices=sorted(BY_NAME))
    run.add_argument("--artifacts", default=os.environ.get("PAGEDWEIGHT_ARTIFACTS", "/work/artifacts/paged"),
                     help="folder of paged models, one per model name (pagedweight quantize writes them)")
    run.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    tables = sub.add_parser("tables", help="rewrite the docs' tables from bench/results/")
    tables.add_argument("--check", action="store_true", help="exit 1 where a page is stale; write nothing")
    args = parser.parse_args(own)
    if args.verb == "list":
        list_recipes()
        return 0
    if args.verb == "tables":
        from bench import tables as docs_tables

        return docs_tables.main(["--check"] if args.check else [])
    recipe = BY_NAME[args.recipe]
    cmd = command(recipe, args.artifacts, extra)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    staged: list[Path] = []
    if recipe.name == "quantize-full-depth":
        cmd, staged = full_depth_staging(cmd)
    try:
        return subprocess.run(cmd, cwd=REPO, env=child_env()).returncode
    finally:
        for path in staged:  # tens of GB, some of it in RAM (/dev/shm)
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
