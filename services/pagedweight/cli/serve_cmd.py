"""`pagedweight serve`: planner + one worker + gateway as local processes, in one command.

    pagedweight serve --model DIR --port 8000 [--memory-budget 256MiB] [--redis-url URL]

DIR is a paged model, or a Hugging Face checkpoint that is quantised on first start into
a cache folder (--cache-dir, default ~/.cache/pagedweight) and reused afterwards. Sessions
go to Redis at --redis-url (default $REDIS_URL, else redis://127.0.0.1:6379/0); the
gateway falls back to an in-process store, loudly, when none answers. The internal gRPC
calls carry a token made for the run ($PAGEDWEIGHT_RPC_TOKEN when set); a restarted
service gets the same one. Startup ends by printing where to point a client. A service
that dies is restarted (at most MAX_RESTARTS per RESTART_WINDOW_S each; past that the
cluster stops): a worker keeps serving on its last plan while the planner is gone and
registers with the new one. Ctrl-C (or SIGTERM) stops the services in order, the worker
draining its running requests.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

from pagedweight.cli.numbers import port, positive_seconds, seconds
from pagedweight.common.errors import UserError
from pagedweight.common.rpc_security import TOKEN_ENV

MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0  # per service


def register(subparsers) -> None:
    import argparse

    parser = subparsers.add_parser("serve", help="run gateway + worker + planner locally",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="paged model directory or Hugging Face checkpoint")
    parser.add_argument("--port", type=port, default=8000, help="the gateway's HTTP port (OpenAI API)")
    parser.add_argument("--host", default="127.0.0.1", help="interface every service listens on")
    parser.add_argument("--memory-budget", default="256MiB", help="the worker's device budget")
    parser.add_argument("--device", default="cpu", help="the worker's device: cpu or cuda[:N]")
    parser.add_argument("--policy", default="pagedweight", help="planner policy, or static-B")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API "
                                                                  "(None: the --model directory's name)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="where sessions are kept ($REDIS_URL when set)")
    parser.add_argument("--cache-dir", default=None, help="where quantised checkpoints are kept "
                                                          "(None: ~/.cache/pagedweight)")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                        help="calibration text for the first quantisation (None: the shared corpus, "
                             "else data/sample.txt)")
    parser.add_argument("--worker-port", type=port, default=50051, help="the worker's gRPC port")
    parser.add_argument("--planner-port", type=port, default=50052, help="the planner's gRPC port")
    parser.add_argument("--worker-metrics-port", type=port, default=9091, help="the worker's /metrics port")
    parser.add_argument("--planner-metrics-port", type=port, default=9092, help="the planner's /metrics port")
    parser.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                        help="seconds the worker may drain its requests on Ctrl-C")
    parser.add_argument("--startup-timeout", type=positive_seconds, default=600.0, help="seconds each service may take")
    parser.set_defaults(handler=run)


def service_argvs(args, paged_dir: Path) -> dict[str, list[str]]:
    """The command line of each service (a dict in start order)."""
    name = args.served_model_name or Path(args.model).resolve().name
    host = args.host
    return {
        "planner": ["planner", "--host", host, "--port", str(args.planner_port),
                    "--http-port", str(args.planner_metrics_port)],
        "worker": ["worker", "--model", str(paged_dir), "--host", host, "--port", str(args.worker_port),
                   "--http-port", str(args.worker_metrics_port), "--memory-budget", args.memory_budget,
                   "--device", args.device, "--policy", args.policy, "--served-model-name", name,
                   "--planner", f"{host}:{args.planner_port}", "--shutdown-timeout", str(args.shutdown_timeout)],
        "gateway": ["gateway", "--model", str(paged_dir), "--host", host, "--port", str(args.port),
                    "--workers", f"{host}:{args.worker_port}", "--served-model-name", name,
                    "--redis-url", args.redis_url],
    }


def run(args) -> int:
    from pagedweight.cluster.model_cache import DEFAULT_CACHE, paged_model_for
    from pagedweight.cluster.processes import Service, grpc_serving, http_ok, wait_until

    from pagedweight.common.ports import bind_tcp

    # every port first: a taken one is one error line before anything starts or claims to serve
    for flag, port in (("--port", args.port), ("--worker-port", args.worker_port),
                       ("--planner-port", args.planner_port), ("--worker-metrics-port", args.worker_metrics_port),
                       ("--planner-metrics-port", args.planner_metrics_port)):
        bind_tcp(args.host, port, flag).close()
    calib = [Path(f) for f in args.calib] if args.calib else None
    for f in calib or []:
        if not f.is_file():
            raise UserError(f"--calib {f}: no such file")
    paged = paged_model_for(args.model, Path(args.cache_dir) if args.cache_dir else DEFAULT_CACHE, calib)
    # The services' gRPC links need a token (common/rpc_security.py): one made for this run
    # and inherited by the three processes only, unless the operator gave their own.
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))
    services = [Service(n, argv) for n, argv in service_argvs(args, paged).items()]
    planner, worker, gateway = services
    host = args.host
    checks = {
        "planner": lambda: grpc_serving(f"{host}:{args.planner_port}"),
        "worker": lambda: grpc_serving(f"{host}:{args.worker_port}", "pagedweight.v1.Worker"),
        "gateway": lambda: http_ok(f"http://{host}:{args.port}/health"),
    }
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Ctrl-C / `kill -INT` stops the cluster even when serve was started with SIGINT ignored
    # (a shell script's background job inherits SIG_IGN, and Python then keeps it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for service in services:
            service.start()
            wait_until(checks[service.name], service, args.startup_timeout)
        name = args.served_model_name or Path(args.model).resolve().name
        print(f"\nPagedWeight is serving {name!r}:\n"
              f"  OpenAI API  http://{host}:{args.port}/v1   (e.g. OPENAI_BASE_URL=http://{host}:{args.port}/v1)\n"
              f"  try         curl http://{host}:{args.port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
              f"  metrics     http://{host}:{args.port}/metrics (gateway), "
              f"http://{host}:{args.worker_metrics_port}/metrics (worker), "
              f"http://{host}:{args.planner_metrics_port}/metrics (planner)\n"
              f"Ctrl-C stops the cluster.\n", flush=True)
        while not stopping:
            for service in services:
                if service.exited is None:
                    continue
                if not service.may_restart(MAX_RESTARTS, RESTART_WINDOW_S):
                    raise RuntimeError(f"{service.name} exited with code {service.exited} "
                                       f"{MAX_RESTARTS} times within {RESTART_WINDOW_S:.0f}s")
                print(f"pagedweight serve: {service.name} exited with code {service.exited}; restarting it",
                      file=sys.stderr, flush=True)
                service.start()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as err:
        print(f"pagedweight serve: {err}; stopping the cluster", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
        for service in (gateway, worker, planner):
            service.stop(args.shutdown_timeout + 10)
    return 0
