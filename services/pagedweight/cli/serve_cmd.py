"""`pagedweight serve`: planner + workers + gateway as local processes, in one command.

    pagedweight serve --model DIR --port 8000 [--workers N] [--memory-budget 256MiB] [--redis-url URL]

DIR is a paged model, or a Hugging Face checkpoint that is quantised on first start into
a cache folder (--cache-dir, default ~/.cache/pagedweight) and reused afterwards. Sessions
go to Redis at --redis-url (default $REDIS_URL, else redis://127.0.0.1:6379/0); the
gateway falls back to an in-process store, loudly, when none answers. The internal gRPC
calls carry a token made for the run ($PAGEDWEIGHT_RPC_TOKEN when set); a restarted
service gets the same one. `--workers N` starts N workers behind the one gateway and
planner: on CUDA one per GPU, each seeing only its own (CUDA_VISIBLE_DEVICES), on the CPU
N processes; each has its own gRPC and metrics port (cluster/layout.py). Startup ends by
printing where to point a client. A service that dies is restarted (at most MAX_RESTARTS
per RESTART_WINDOW_S each; past that the cluster stops): a worker keeps serving on its
last plan while the planner is gone and registers with the new one, and the gateway
routes around a dead worker until it is back. Ctrl-C (or SIGTERM) stops the services in
order, the workers draining their running requests.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

from pagedweight.cli.numbers import port, positive_int, positive_seconds, seconds
from pagedweight.cluster.layout import MAX_PORT, WorkerSlot, check_ports_apart, visible_gpus, worker_env
from pagedweight.cluster.layout import worker_gpus, worker_slots
from pagedweight.common.errors import UserError
from pagedweight.common.rpc_security import TOKEN_ENV

MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0  # per service


def register(subparsers) -> None:
    import argparse

    parser = subparsers.add_parser("serve", help="run gateway + workers + planner locally",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="paged model directory or Hugging Face checkpoint")
    parser.add_argument("--port", type=port, default=8000, help="the gateway's HTTP port (OpenAI API)")
    parser.add_argument("--host", default="127.0.0.1", help="interface every service listens on")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="workers behind the gateway: on cuda one per GPU (at most the GPUs visible)")
    parser.add_argument("--memory-budget", default="256MiB", help="each worker's device budget")
    parser.add_argument("--device", default="cpu", help="the workers' device: cpu, cuda (one GPU per worker) "
                                                        "or cuda:K (one worker on GPU K)")
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
    parser.add_argument("--worker-port", type=port, default=50051,
                        help="the first worker's gRPC port (worker i listens on this + i)")
    parser.add_argument("--planner-port", type=port, default=None,
                        help="the planner's gRPC port (None: the one after the workers', 50052 with one worker)")
    parser.add_argument("--worker-metrics-port", type=port, default=9091,
                        help="the first worker's /metrics port (worker i serves it on this + i)")
    parser.add_argument("--planner-metrics-port", type=port, default=None,
                        help="the planner's /metrics port (None: the one after the workers', 9092 with one worker)")
    parser.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                        help="seconds the worker may drain its requests on Ctrl-C")
    parser.add_argument("--startup-timeout", type=positive_seconds, default=600.0, help="seconds each service may take")
    parser.set_defaults(handler=run)


def plan_layout(args, num_visible_gpus=None) -> tuple[list[WorkerSlot], int, int]:
    """The workers' slots and the planner's gRPC and metrics ports; bad flags are a UserError.

    num_visible_gpus: what CUDA counts (asked only on a CUDA device when None)."""
    gpus = None
    if args.device.startswith("cuda"):
        if num_visible_gpus is None:
            num_visible_gpus = _cuda_device_count()
        gpus = visible_gpus(num_visible_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    slots = worker_slots(args.workers, args.worker_port, args.worker_metrics_port,
                         worker_gpus(args.workers, args.device, gpus))
    planner_port = args.planner_port if args.planner_port is not None else slots[-1].port + 1
    planner_metrics = args.planner_metrics_port if args.planner_metrics_port is not None \
        else slots[-1].metrics_port + 1
    for flag, value in (("--planner-port", planner_port), ("--planner-metrics-port", planner_metrics)):
        if value > MAX_PORT:
            raise UserError(f"{flag}: the port after the workers' would be {value}, past {MAX_PORT}; give one")
    check_ports_apart(listen_ports(args, slots, planner_port, planner_metrics))
    return slots, planner_port, planner_metrics


def listen_ports(args, slots: list[WorkerSlot], planner_port: int, planner_metrics_port: int) -> dict[str, int]:
    """Every port the cluster listens on, by the flag that sets it (worker i's: the first
    worker's flag + i)."""
    ports = {}
    for i, slot in enumerate(slots):
        suffix = f" + {i} ({slot.name})" if i else ""
        ports[f"--worker-port{suffix}"] = slot.port
        ports[f"--worker-metrics-port{suffix}"] = slot.metrics_port
    return {**ports, "--planner-port": planner_port, "--planner-metrics-port": planner_metrics_port,
            "--port": args.port}


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def service_argvs(args, paged_dir: Path, slots: list[WorkerSlot], planner_port: int,
                  planner_metrics_port: int) -> dict[str, list[str]]:
    """The command line of each service (a dict in start order: planner, workers, gateway)."""
    name = args.served_model_name or Path(args.model).resolve().name
    host = args.host
    # a worker given one GPU through CUDA_VISIBLE_DEVICES sees it as cuda:0
    device = "cuda" if any(s.cuda_visible_devices is not None for s in slots) else args.device
    argvs = {"planner": ["planner", "--host", host, "--port", str(planner_port),
                         "--http-port", str(planner_metrics_port)]}
    for slot in slots:
        argvs[slot.name] = [
            "worker", "--model", str(paged_dir), "--host", host, "--port", str(slot.port),
            "--http-port", str(slot.metrics_port), "--memory-budget", args.memory_budget,
            "--device", device, "--policy", args.policy, "--served-model-name", name,
            "--planner", f"{host}:{planner_port}", "--shutdown-timeout", str(args.shutdown_timeout)]
    argvs["gateway"] = ["gateway", "--model", str(paged_dir), "--host", host, "--port", str(args.port),
                        "--workers", ",".join(f"{host}:{s.port}" for s in slots), "--served-model-name", name,
                        "--redis-url", args.redis_url]
    return argvs


def run(args) -> int:
    from pagedweight.cluster.model_cache import DEFAULT_CACHE, paged_model_for
    from pagedweight.cluster.processes import Service, grpc_serving, http_ok, stop_together, wait_until

    from pagedweight.common.ports import bind_tcp

    slots, planner_port, planner_metrics_port = plan_layout(args)
    # every port first: a taken one is one error line before anything starts or claims to serve
    for flag, port in listen_ports(args, slots, planner_port, planner_metrics_port).items():
        bind_tcp(args.host, port, flag).close()
    calib = [Path(f) for f in args.calib] if args.calib else None
    for f in calib or []:
        if not f.is_file():
            raise UserError(f"--calib {f}: no such file")
    paged = paged_model_for(args.model, Path(args.cache_dir) if args.cache_dir else DEFAULT_CACHE, calib)
    # The services' gRPC links need a token (common/rpc_security.py): one made for this run
    # and inherited by the services only, unless the operator gave their own.
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))
    argvs = service_argvs(args, paged, slots, planner_port, planner_metrics_port)
    envs = {s.name: worker_env(s) for s in slots}
    services = {n: Service(n, argv, env=envs.get(n, {})) for n, argv in argvs.items()}
    planner, gateway = services["planner"], services["gateway"]
    workers = [services[s.name] for s in slots]
    host = args.host
    checks = {"planner": lambda: grpc_serving(f"{host}:{planner_port}"),
              "gateway": lambda: http_ok(f"http://{host}:{args.port}/health")}
    for slot in slots:
        checks[slot.name] = lambda port=slot.port: grpc_serving(f"{host}:{port}", "pagedweight.v1.Worker")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Ctrl-C / `kill -INT` stops the cluster even when serve was started with SIGINT ignored
    # (a shell script's background job inherits SIG_IGN, and Python then keeps it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for group in ([planner], workers, [gateway]):  # the workers load their model side by side
            for service in group:
                service.start()
            for service in group:
                wait_until(checks[service.name], service, args.startup_timeout)
        print(banner(args, slots, planner_metrics_port), flush=True)
        while not stopping:
            for service in services.values():
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
        for group in ([gateway], workers, [planner]):  # the workers drain side by side
            stop_together(group, args.shutdown_timeout + 10)
    return 0


def banner(args, slots: list[WorkerSlot], planner_metrics_port: int) -> str:
    """Where to point a client, printed once every service is ready."""
    name = args.served_model_name or Path(args.model).resolve().name
    host, port = args.host, args.port
    workers = ", ".join(f"http://{host}:{s.metrics_port}/metrics" for s in slots)
    on = "" if slots[0].cuda_visible_devices is None else \
        " on GPU " + ", ".join(s.cuda_visible_devices for s in slots)
    return (f"\nPagedWeight is serving {name!r} with {len(slots)} worker{'s' if len(slots) > 1 else ''}{on}:\n"
            f"  OpenAI API  http://{host}:{port}/v1   (e.g. OPENAI_BASE_URL=http://{host}:{port}/v1)\n"
            f"  try         curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
            f"  metrics     http://{host}:{port}/metrics (gateway), {workers} "
            f"(worker{'s' if len(slots) > 1 else ''}), http://{host}:{planner_metrics_port}/metrics (planner)\n"
            f"Ctrl-C stops the cluster.\n")
