"""`pagedweight worker`: serve one paged model over gRPC (the worker service).

    pagedweight worker --model PAGED_DIR --port 50051 [--planner 127.0.0.1:50052] \\
        [--memory-budget 256MiB] [--http-port 9091] [--shutdown-timeout 30]
"""

from __future__ import annotations

import asyncio
import logging

from pagedweight.cli.numbers import port
from pagedweight.cli.rpc_args import add_rpc_security_arguments
from pagedweight.worker.config import WorkerConfig


def register(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="serve a paged model over gRPC (the worker service)")
    d = WorkerConfig.__dataclass_fields__
    parser.add_argument("--model", required=True, help="paged model directory (pagedweight quantize)")
    parser.add_argument("--port", type=port, default=d["port"].default, help="gRPC port (0: any free one)")
    parser.add_argument("--host", default=d["host"].default, help="interface to listen on")
    parser.add_argument("--http-port", "--metrics-port", dest="http_port", type=port, default=None,
                        help="side HTTP port for /metrics, /health, /ready (default: none)")
    parser.add_argument("--memory-budget", default=d["memory_budget"].default,
                        help="bytes for weights + KV + workspace (e.g. 256MiB), or a fraction of the GPU")
    parser.add_argument("--policy", default=d["policy"].default, help="planner policy, or static-B")
    parser.add_argument("--prompt-residuals", action="store_true", default=d["prompt_residuals"].default,
                        help="plans also see the prompts in flight through the artifact's residual heads "
                             "(opt-in: no measured gain on held-out text, docs/calibration.md)")
    parser.add_argument("--device", default=d["device"].default)
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16")
    parser.add_argument("--served-model-name", default=None, help="name in the API and metrics")
    parser.add_argument("--planner", default=None, metavar="HOST:PORT",
                        help="planner service address (default: the in-process planner only)")
    parser.add_argument("--planner-deadline", type=float, default=d["planner_deadline_s"].default,
                        help="seconds a plan may take before the in-process planner answers instead")
    parser.add_argument("--worker-id", default=None, help="name at the planner service (default host:port)")
    parser.add_argument("--shutdown-timeout", type=float, default=d["shutdown_timeout_s"].default,
                        help="on SIGTERM, seconds running requests get before they are aborted")
    parser.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default)
    parser.add_argument("--block-size", type=int, default=d["block_size"].default)
    parser.add_argument("--threads", type=int, default=d["threads"].default, help="torch CPU threads")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip meeting every decode bucket before readiness (faster start, slow first steps)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly, without CUDA graphs (vLLM's flag; for debugging)")
    add_rpc_security_arguments(parser, server=True)
    parser.set_defaults(handler=run)


def config_from_args(args) -> WorkerConfig:
    return WorkerConfig(
        model_dir=args.model, port=args.port, host=args.host, http_port=args.http_port,
        memory_budget=args.memory_budget, policy=args.policy, prompt_residuals=args.prompt_residuals,
        device=args.device, dtype=args.dtype,
        served_model_name=args.served_model_name, planner_address=args.planner,
        planner_deadline_s=args.planner_deadline, worker_id=args.worker_id,
        shutdown_timeout_s=args.shutdown_timeout, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, threads=args.threads,
        warm_up=args.warm_up, enforce_eager=args.enforce_eager, rpc_token_file=args.rpc_token_file,
        rpc_tls_cert=args.rpc_tls_cert, rpc_tls_key=args.rpc_tls_key, rpc_tls_ca=args.rpc_tls_ca,
        insecure_rpc=args.insecure_rpc)


def run(args) -> int:
    from pagedweight.worker.server import serve

    config = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(config))
    return 0
