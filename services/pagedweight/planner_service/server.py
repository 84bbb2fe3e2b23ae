"""The planner service's gRPC server: Register / Plan, health, /metrics.

    pagedweight planner --port 50052 [--http-port 9092]

One `WorkerPlanState` per registered worker id, replaced when the worker registers
again (a restarted worker). A Plan for an unknown worker or a stale registration id is
NOT_FOUND, which tells the worker to register again (after this service restarted).
Plans are computed in a thread so one slow plan does not hold up health checks.
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
from pagedweight.common.metrics import PlannerServiceMetrics
from pagedweight.common.ports import GRPC_SERVER_OPTIONS, add_grpc_port, bind_tcp
from pagedweight.common.status_http import StatusHttpServer
from pagedweight.planner_service.state import WorkerPlanState
from pagedweight.rpc import planner_messages, planner_pb2, planner_pb2_grpc

log = logging.getLogger("pagedweight.planner")
SERVICE_NAME = "pagedweight.v1.Planner"


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, metrics: PlannerServiceMetrics):
        self.metrics = metrics
        self.workers: dict[str, WorkerPlanState] = {}  # worker_id -> state

    async def Register(self, request, context):
        try:
            state = await asyncio.to_thread(WorkerPlanState, request)
        except UserError as err:
            self.metrics.refused.labels(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        replaced = request.worker_id in self.workers
        self.workers[request.worker_id] = state
        self.metrics.workers_registered.set(len(self.workers))
        log.info("worker %s %s: %d blocks, policy %s", request.worker_id,
                 "re-registered" if replaced else "registered", state.num_blocks, state.policy_name)
        return planner_pb2.RegisterResponse(registration_id=state.registration_id, num_blocks=state.num_blocks)

    async def Plan(self, request, context):
        state = self.workers.get(request.worker_id)
        if state is None or state.registration_id != request.registration_id:
            self.metrics.refused.labels(code="NOT_FOUND").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"worker {request.worker_id!r} is not registered (or registered again): register")
        started = time.perf_counter()
        try:
            response = await asyncio.to_thread(state.plan, request)
        except UserError as err:
            self.metrics.refused.labels(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        direction = "free" if request.direction == planner_pb2.PlanRequest.FREE else "spend"
        self.metrics.plan_latency.observe(time.perf_counter() - started)
        self.metrics.plans.labels(direction=direction).inc()
        self.metrics.bytes_moved.labels(direction=direction).inc(abs(response.bytes_delta))
        return planner_messages.response_to_proto(response, state.registration)


async def serve(port: int, http_port: int | None, host: str = "127.0.0.1",
                ready: asyncio.Event | None = None) -> None:
    registry = CollectorRegistry()
    metrics = PlannerServiceMetrics(registry)
    metrics.workers_registered.set(0)
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    planner_pb2_grpc.add_PlannerServicer_to_server(PlannerServicer(metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    http_socket = bind_tcp(host, http_port, "--http-port") if http_port is not None else None
    try:
        bound = add_grpc_port(server, host, port)
    except UserError:
        if http_socket is not None:
            http_socket.close()
        raise
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    status = StatusHttpServer(registry, lambda: True, lambda: True)
    if http_socket is not None:
        status.start(host, http_port, http_socket)
    log.info("planner listening on %s:%d (gRPC)%s", host, bound,
             f", metrics on http://{host}:{status.port}/metrics" if http_port is not None else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2.0)
    status.stop()
    log.info("planner stopped")
