"""`pagedweight info MODEL`: what a model needs and what a memory budget buys, before serving it.

Reads config.json and tensor headers only (planner/sizing.py); never loads a weight.
The worker logs the same report at start-up (runtime.py).
"""

from __future__ import annotations

import json

from pagedweight.common.errors import UserError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="sizes of a checkpoint or paged model, and what a memory budget buys")
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory or paged model directory")
    parser.add_argument("--memory-budget", default=None,
                        help="device bytes for weights, KV and workspace ('24GiB', '512M', '123456789')")
    parser.add_argument("--context", type=int, default=None, help="tokens per request (prompt + output)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests served at once")
    parser.add_argument("--device", default="cpu",
                        help="the worker's device, cpu or cuda[:N] (default: cpu, as the worker's); "
                             "it picks the default --dtype")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="serving dtype of dense weights and KV (default: the worker's on --device: "
                             "float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.set_defaults(handler=run_info)


def run_info(args) -> int:
    from pagedweight.engine.engine import EngineConfig
    from pagedweight.memory.arena import DEFAULT_PAGE_BYTES
    from pagedweight.memory.pool import parse_memory_budget
    from pagedweight.planner.sizing import format_sizing, model_sizes, sizing_report
    from pagedweight.runtime import workspace_bytes
    from pagedweight.format.model_config import ModelConfig
    from pathlib import Path

    if (args.context is None) != (args.concurrency is None):
        raise UserError("--context and --concurrency go together")
    if args.context is not None:
        if args.memory_budget is None:
            raise UserError("--context and --concurrency need --memory-budget")
        if args.context < 1 or args.concurrency < 1:
            raise UserError(f"--context and --concurrency must be >= 1, got {args.context} and {args.concurrency}")
    budget = parse_memory_budget(args.memory_budget) if args.memory_budget is not None else None
    if not Path(args.model).is_dir():
        raise UserError(f"{args.model}: model directory does not exist")
    if args.dtype is None:  # what a worker started with the same --device runs at
        args.dtype = "float32" if args.device.split(":")[0] == "cpu" else "bfloat16"
    engine = EngineConfig()
    import torch

    dtype = getattr(torch, args.dtype)
    workspace = workspace_bytes(ModelConfig.from_dir(Path(args.model)), engine, dtype)
    sizes = model_sizes(args.model, args.dtype, DTYPE_BYTES[args.dtype], workspace, DEFAULT_PAGE_BYTES,
                        engine.kv.block_size)
    report = sizing_report(sizes, budget, args.context, args.concurrency)
    print(json.dumps(report, indent=1) if args.json else format_sizing(report))
    return 0
