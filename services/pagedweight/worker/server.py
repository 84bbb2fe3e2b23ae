"""The worker process: gRPC server, health, side HTTP port, model loading, SIGTERM drain.

Start-up: the gRPC server and health service come up first (liveness SERVING, readiness
NOT_SERVING) so probes see a live process while the model loads in a thread; then the
engine is attached, the planner service link (if any) installed, readiness SERVING.

A dead engine (a step raised; AsyncEngine.errored) turns liveness and readiness
NOT_SERVING and new requests get UNAVAILABLE.

Drain (SIGTERM or SIGINT): readiness NOT_SERVING and new Generate calls get UNAVAILABLE
(a gateway retries them elsewhere); running requests get `shutdown_timeout_s` to finish;
those still running are aborted, so their streams end with finish_reason "abort"
(never cut silently); then the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pagedweight.common.errors import UserError
from pagedweight.common.gc_pauses import freeze_startup_heap
from pagedweight.common.metrics import EngineMetrics, WorkerMetrics
from pagedweight.common.ports import GRPC_SERVER_OPTIONS, bind_tcp
from pagedweight.common.status_http import StatusHttpServer
from pagedweight.rpc import worker_pb2_grpc
from pagedweight.worker.config import WorkerConfig
from pagedweight.worker.servicer import WorkerServicer

log = logging.getLogger("pagedweight.worker")
SERVICE_NAME = "pagedweight.v1.Worker"  # the readiness service name in grpc.health.v1


def load_runtime(config: WorkerConfig, progress=None):
    """The engine's runtime (runtime.build_runtime) from the worker's flags; progress(phase)
    hears each start-up phase (runtime.STARTUP_PHASES)."""
    import torch

    from pagedweight.model.dtypes import DTYPES
    from pagedweight.engine.engine import EngineConfig
    from pagedweight.engine.scheduler import SchedulerConfig
    from pagedweight.memory.kv_cache import KVCacheConfig
    from pagedweight.memory.pool import device_memory_bytes, parse_memory_budget
    from pagedweight.runtime import RuntimeConfig, build_runtime

    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {config.device}: CUDA is not available on this machine")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
    dtype = DTYPES[config.dtype] if config.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    budget = parse_memory_budget(config.memory_budget, device_memory_bytes(device))
    engine = EngineConfig(scheduler=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                          kv=KVCacheConfig(config.block_size), enforce_eager=config.enforce_eager)
    runtime = build_runtime(config.model_dir, RuntimeConfig(budget, config.policy, str(device), dtype, engine=engine,
                                                               prompt_residuals=config.prompt_residuals),
                            progress=progress)
    if progress is not None:
        progress("warming up")
    if config.warm_up:
        start = time.monotonic()
        buckets = runtime.warm_up()
        if buckets:
            log.info("met decode buckets %s in %.1fs", buckets, time.monotonic() - start)
    # Start-up is over (with or without the warm-up): what is alive now stays, so full
    # collections need not walk it (common/gc_pauses.py: a full pass, 0.2-0.3 s, is the
    # candidate for the H200's ~0.3 s stall once per trace)
    log.info("froze %d start-up objects out of the garbage collector", freeze_startup_heap())
    return runtime


def attach_planner_service(runtime, config: WorkerConfig, address: str, metrics: WorkerMetrics):
    """Put the planner service in front of the pager's in-process planner; returns it."""
    from pagedweight.planner.messages import PlannerRegistration
    from pagedweight.worker.remote_planner import RemotePlanner

    local = runtime.pager.planner  # the InProcessPlanner build_runtime registered
    t = local.table  # registration order = the page table's = the pager's
    registration = PlannerRegistration(tuple(b.key() for b in t.block_ids), t.nbytes, t.sensitivity,
                                       t.num_layers, t.num_experts, local.stats.top_k, t.calib_mass, t.calib_share)
    remote = RemotePlanner(address, local, config.worker_id or f"{config.host}:{config.port}", config.model_name,
                           config.policy, deadline_s=config.planner_deadline_s, metrics=metrics,
                           security=config.security())
    remote.register(registration)
    runtime.pager.planner = remote
    return remote


async def serve(config: WorkerConfig, started: asyncio.Event | None = None) -> None:
    from pagedweight.engine.async_engine import AsyncEngine
    from pagedweight.format.model_config import ModelConfig

    from pagedweight.common.startup import StartupProgress
    from pagedweight.runtime import STARTUP_PHASES

    model_config = ModelConfig.from_dir(config.model_dir)
    eos = model_config.eos_token_ids[0] if model_config.eos_token_ids else -1
    security = config.security()
    servicer = WorkerServicer(config.model_name, model_config.max_position_embeddings, eos, security)
    server = grpc.aio.server(interceptors=security.interceptors(), options=GRPC_SERVER_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # both ports before anything else: a taken one (or an unauthenticated public one) is one
    # error line, not a half-started worker
    http_socket = bind_tcp(config.host, config.http_port, "--http-port") if config.http_port is not None else None
    try:
        port = security.add_port(server, config.host, config.port)
    except UserError:
        if http_socket is not None:
            http_socket.close()
        raise
    # before the side port answers: /health carries the phase and percent from its first answer
    servicer.startup = StartupProgress("worker", STARTUP_PHASES, log)
    registry = CollectorRegistry()
    status = StatusHttpServer(registry, lambda: servicer.live, lambda: servicer.ready,
                              lambda: servicer.telemetry.refresh() if servicer.telemetry is not None else None,
                              lambda: servicer.health())
    if http_socket is not None:
        status.start(config.host, config.http_port, http_socket)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("worker %s: gRPC on %s:%d, loading %s", config.model_name, config.host, port, config.model_dir)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    t0 = time.monotonic()
    try:
        runtime = await asyncio.to_thread(load_runtime, config, servicer.startup.begin)
    except BaseException:  # a bad flag or model: one error line from the CLI, no dangling server
        servicer.startup.close()
        await server.stop(grace=None)
        status.stop()
        raise
    vllm = EngineMetrics(registry, config.model_name, model_config.max_position_embeddings)
    ours = WorkerMetrics(registry, config.model_name)
    remote = None
    if config.planner_address and runtime.pager is not None:
        remote = attach_planner_service(runtime, config, config.planner_address, ours)
    elif config.planner_address:
        log.warning("policy %s never moves weights: --planner %s is not used", config.policy, config.planner_address)
    from pagedweight.worker.telemetry import WorkerTelemetry

    engine = AsyncEngine(runtime.engine)
    servicer.telemetry = WorkerTelemetry(runtime, engine, vllm, ours, remote)
    servicer.engine = engine
    servicer.startup.ready()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %s ready in %.1fs: gRPC %s:%d%s%s", config.model_name, time.monotonic() - t0, config.host,
             port, f", metrics http://{config.host}:{status.port}/metrics" if status.port else "",
             f", planner service {config.planner_address}" if remote else ", in-process planner")
    if started is not None:
        started.set()

    watcher = asyncio.create_task(watch_engine(servicer, health_servicer))
    await stop.wait()
    watcher.cancel()
    await drain(servicer, health_servicer, config.shutdown_timeout_s)
    await server.stop(grace=1.0)
    status.stop()
    await engine.close()
    if remote is not None:
        remote.close()
    runtime.close()
    log.info("worker stopped")


async def watch_engine(servicer: WorkerServicer, health_servicer, every_s: float = 0.5) -> None:
    """A dead engine (a step raised) makes liveness and readiness NOT_SERVING: a
    supervisor restarts the process, routers stop sending it requests."""
    while not servicer.engine.errored:
        await asyncio.sleep(every_s)
    log.error("engine is dead (%s): liveness and readiness NOT_SERVING; restart this worker",
              servicer.engine.dead_error)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def drain(servicer: WorkerServicer, health_servicer, timeout_s: float) -> None:
    servicer.draining = True
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: %d running requests get %.0fs to finish", len(servicer.running), timeout_s)
    try:
        await asyncio.wait_for(servicer.idle.wait(), timeout_s)
        return
    except asyncio.TimeoutError:
        pass
    num = servicer.abort_all()
    log.warning("drain timeout: aborted %d running requests (finish_reason abort)", num)
    try:
        await asyncio.wait_for(servicer.idle.wait(), 5.0)  # their final messages go out
    except asyncio.TimeoutError:
        log.error("%d aborted streams did not end", len(servicer.running))
