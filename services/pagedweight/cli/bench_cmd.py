"""`pagedweight bench engine`: a closed-loop load on one worker; prints one JSON line last.

    pagedweight bench engine --model PAGED_DIR --memory-budget 24MiB --requests 64 \\
        --concurrency 16 --prompt-len 64 --max-tokens 64 [--policy pagedweight] [--device cpu]

`--policy` is a planner policy (pagedweight, uniform, mxmoe, dpllm, no-routing,
no-residual, no-sensitivity: bits move with the load) or static-B (every expert block
pinned at B bits). Progress goes to stderr; the JSON object is the last stdout line.
`--plot FILE.png` also draws the memory split over time (stacked by bit-width and KV) with
preemptions and page moves marked (cli/memory_plot.py; needs matplotlib).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from pagedweight.cli.config_defaults import default_of
from pagedweight.cli.load_bench import LoadSpec
from pagedweight.cli.model_args import DTYPES, parse_device
from pagedweight.common.errors import UserError
from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.runtime import RuntimeConfig


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    targets = parser.add_subparsers(dest="target", required=True)
    engine = targets.add_parser("engine", help="load the continuous-batching engine")
    engine.add_argument("--model", required=True, help="paged model directory (pagedweight quantize)")
    engine.add_argument("--memory-budget", required=True,
                        help="bytes for weights + KV + workspace (e.g. 24MiB, or 0.9 of a GPU)")
    engine.add_argument("--requests", type=int, default=default_of(LoadSpec, "num_requests"))
    engine.add_argument("--concurrency", type=int, default=default_of(LoadSpec, "concurrency"))
    engine.add_argument("--prompt-len", type=int, default=default_of(LoadSpec, "prompt_len"))
    engine.add_argument("--max-tokens", type=int, default=default_of(LoadSpec, "max_tokens"))
    engine.add_argument("--policy", default=default_of(RuntimeConfig, "policy"), help="planner policy, or static-B")
    engine.add_argument("--scales", default=None,
                        help="loss scales: default the artifact's; 'raw' for none; or a plan-scales file")
    engine.add_argument("--device", default=default_of(RuntimeConfig, "device"))
    engine.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    engine.add_argument("--max-num-seqs", type=int, default=default_of(SchedulerConfig, "max_num_seqs"))
    engine.add_argument("--max-num-batched-tokens", type=int,
                        default=default_of(SchedulerConfig, "max_num_batched_tokens"))
    engine.add_argument("--block-size", type=int, default=default_of(KVCacheConfig, "block_size"))
    engine.add_argument("--seed", type=int, default=default_of(LoadSpec, "seed"))
    engine.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: OpenMP threads spin on a loaded small machine)")
    engine.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw the memory split over time, with preemptions and page moves, to this PNG")
    parser.set_defaults(handler=run)


def run(args) -> int:
    result = run_engine_bench(args)
    print(json.dumps(result))
    return 0


def run_engine_bench(args) -> dict:
    from pagedweight.cli.load_bench import run_load
    from pagedweight.memory.pool import device_memory_bytes, parse_memory_budget
    from pagedweight.runtime import build_runtime

    for name in ("requests", "concurrency", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _check_policy(args.policy)
    if args.plot is not None:
        from pagedweight.cli.memory_plot import check_plot_path

        check_plot_path(args.plot)  # before minutes of load, not after
    if not 1 <= args.threads <= 1024:
        raise UserError(f"--threads must be in 1..1024, got {args.threads}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in 0..2^63-1, got {args.seed}")
    torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    budget = parse_memory_budget(args.memory_budget, device_memory_bytes(device))
    engine = EngineConfig(
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
        kv=KVCacheConfig(args.block_size),
    )
    config = RuntimeConfig(budget, args.policy, str(device), dtype, engine=engine, scales_file=args.scales)
    started = time.time()
    runtime = build_runtime(args.model, config)
    print(f"bench engine: runtime ready in {time.time() - started:.1f}s", file=sys.stderr)
    try:
        spec = LoadSpec(args.requests, args.concurrency, args.prompt_len, args.max_tokens, args.seed)
        timeline = None
        if args.plot is not None:
            from pagedweight.cli.memory_timeline import MemoryTimeline

            timeline = MemoryTimeline()
            timeline.record(runtime)
            result = run_load(runtime, spec, on_step=lambda: timeline.record(runtime))
        else:
            result = run_load(runtime, spec)
    finally:
        runtime.close()
    if timeline is not None:
        from pagedweight.cli.memory_plot import plot_memory_timeline

        title = (f"{Path(args.model).name}: policy {args.policy}, budget {args.memory_budget}, "
                 f"{args.requests} requests at concurrency {args.concurrency}")
        result["plot"] = str(plot_memory_timeline(timeline, args.plot, title))
    return {
        "bench": "engine", "model": str(args.model), "policy": args.policy, "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "requests": args.requests,
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "machine": platform.node(), **result,
    }


def _check_policy(name: str) -> None:
    """A planner policy or static-B, checked before the model is loaded."""
    from pagedweight.planner.policies import POLICY_NAMES
    from pagedweight.runtime import STATIC_PREFIX

    if name not in POLICY_NAMES and not name.startswith(STATIC_PREFIX):
        raise UserError(f"--policy {name[:40]!r}: choose one of {', '.join(POLICY_NAMES)}, or static-B "
                        f"(B in 3..8)")
