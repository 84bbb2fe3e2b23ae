"""The planner service's gRPC server: Register / Plan, health, /metrics.

    pagedweight planner --port 50052 [--http-port 9092]

One `WorkerPlanState` per registered worker id, replaced when the worker registers
again (a restarted worker). A Plan for an unknown worker or a stale registration id is
NOT_FOUND, which tells the worker to register again (after this service restarted).
Plans are computed in a thread so one slow plan does not hold up health checks.

Registrations are bounded and expire: at most `max_workers` at once, and at most an even
share of them (`max_workers` over the token file's caller names, rounded up) per caller,
so one token holder cannot fill the service (RESOURCE_EXHAUSTED past either, after
expired ones are dropped); one with no Register or Plan for
`registration_ttl_s` is dropped (its worker, idle until then, registers again on its next
plan's NOT_FOUND). Every call is authenticated (common/rpc_security.py) and a worker id
belongs to the caller that registered it: another caller can neither replace it nor
receive its plans.

The operator's dial (planner/dial.py) is one for the service: set at start, changed by
SetDial, applied to every worker's plans from the next one on, exported as gauges with a
counter of the requests it cut or held.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pagedweight.common.errors import UserError
from pagedweight.common.metrics import PlannerServiceMetrics
from pagedweight.common.ports import GRPC_SERVER_OPTIONS, bind_tcp
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.common.status_http import StatusHttpServer
from pagedweight.planner.dial import OperatorDial
from pagedweight.planner_service.state import WorkerPlanState
from pagedweight.rpc import planner_messages, planner_pb2, planner_pb2_grpc

log = logging.getLogger("pagedweight.planner")
SERVICE_NAME = "pagedweight.v1.Planner"


MAX_WORKER_ID_CHARS = 256


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, metrics: PlannerServiceMetrics, security: RpcSecurity | None = None,
                 max_workers: int = 64, registration_ttl_s: float = 900.0, dial: OperatorDial = OperatorDial()):
        self.metrics = metrics
        self._set_dial(dial)
        self.security = security or RpcSecurity()
        self.max_workers, self.registration_ttl_s = max_workers, registration_ttl_s
        self.workers: dict[str, WorkerPlanState] = {}  # worker_id -> state
        self.owners: dict[str, str] = {}  # worker_id -> the caller that registered it
        self.last_seen: dict[str, float] = {}  # worker_id -> time.monotonic() of its last call
        num_callers = max(len(set(self.security.tokens.values())), 1)
        self.max_workers_per_caller = math.ceil(max_workers / num_callers)

    def expire(self) -> None:
        cutoff = time.monotonic() - self.registration_ttl_s
        for worker_id in [w for w, seen in self.last_seen.items() if seen < cutoff]:
            log.info("worker %s: no call in %.0f s; registration dropped", worker_id, self.registration_ttl_s)
            for table in (self.workers, self.owners, self.last_seen):
                table.pop(worker_id, None)
        self.metrics.workers_registered.set(len(self.workers))

    def _set_dial(self, dial: OperatorDial) -> None:
        self.dial = dial
        self.metrics.dial_min_mean_bits.set(dial.min_mean_bits)
        self.metrics.dial_target_itl.set(dial.target_itl_s)

    async def SetDial(self, request, context):
        self.security.caller(context)
        try:
            dial = OperatorDial(request.min_mean_bits, request.target_itl_s)
        except ValueError as err:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        self._set_dial(dial)
        log.info("dial set: min mean bits %s, target inter-token latency %s s", dial.min_mean_bits or "off",
                 dial.target_itl_s or "off")
        return planner_pb2.Dial(min_mean_bits=dial.min_mean_bits, target_itl_s=dial.target_itl_s)

    def _full(self, caller: str) -> str | None:
        """Why `caller` may not register one more worker; None when it may."""
        if len(self.workers) >= self.max_workers:
            return f"{self.max_workers} workers are registered (--max-workers); none more"
        if sum(owner == caller for owner in self.owners.values()) >= self.max_workers_per_caller:
            return (f"this caller has {self.max_workers_per_caller} workers registered, its share of "
                    f"--max-workers; none more")
        return None

    async def _refuse(self, context, code: grpc.StatusCode, message: str):
        self.metrics.refused.labels(code=code.name).inc()
        await context.abort(code, message)

    async def Register(self, request, context):
        caller = self.security.caller(context)
        if len(request.worker_id) > MAX_WORKER_ID_CHARS:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"worker_id is longer than {MAX_WORKER_ID_CHARS} characters")
        self.expire()
        replaced = request.worker_id in self.workers
        if replaced and self.owners.get(request.worker_id) != caller:
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                               f"worker {request.worker_id!r} is registered by another caller")
        if not replaced and (full := self._full(caller)):
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, full)
        try:
            state = await asyncio.to_thread(WorkerPlanState, request)
        except UserError as err:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if request.worker_id not in self.workers and (full := self._full(caller)):
            # another registration won the race while this one was being built
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, full)
        self.workers[request.worker_id] = state
        self.owners[request.worker_id] = caller
        self.last_seen[request.worker_id] = time.monotonic()
        self.metrics.workers_registered.set(len(self.workers))
        log.info("worker %s %s: %d blocks, policy %s", request.worker_id,
                 "re-registered" if replaced else "registered", state.num_blocks, state.policy_name)
        return planner_pb2.RegisterResponse(registration_id=state.registration_id, num_blocks=state.num_blocks)

    async def Plan(self, request, context):
        self.expire()
        state = self.workers.get(request.worker_id)
        if state is not None and self.owners.get(request.worker_id) != self.security.caller(context):
            state = None  # another caller's worker: as if unknown, its plans are not theirs
        if state is None or state.registration_id != request.registration_id:
            self.metrics.refused.labels(code="NOT_FOUND").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"worker {request.worker_id!r} is not registered (or registered again): register")
        self.last_seen[request.worker_id] = time.monotonic()
        started = time.perf_counter()
        try:
            limited = dict(state.planner.num_limited)
            response = await asyncio.to_thread(state.plan, request, self.dial)
        except UserError as err:
            self.metrics.refused.labels(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        direction = "free" if request.direction == planner_pb2.PlanRequest.FREE else "spend"
        self.metrics.plan_latency.observe(time.perf_counter() - started)
        for reason, count in state.planner.num_limited.items():
            if count > limited[reason]:
                self.metrics.dial_limited.labels(reason=reason).inc(count - limited[reason])
        self.metrics.plans.labels(direction=direction).inc()
        self.metrics.bytes_moved.labels(direction=direction).inc(abs(response.bytes_delta))
        return planner_messages.response_to_proto(response, state.registration)


async def serve(port: int, http_port: int | None, host: str = "127.0.0.1",
                ready: asyncio.Event | None = None, security: RpcSecurity | None = None,
                max_workers: int = 64, registration_ttl_s: float = 900.0,
                dial: OperatorDial = OperatorDial()) -> None:
    security = security or RpcSecurity()
    registry = CollectorRegistry()
    metrics = PlannerServiceMetrics(registry)
    metrics.workers_registered.set(0)
    server = grpc.aio.server(interceptors=security.interceptors(), options=GRPC_SERVER_OPTIONS)
    planner_pb2_grpc.add_PlannerServicer_to_server(PlannerServicer(metrics, security, max_workers,
                                                                   registration_ttl_s, dial), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    http_socket = bind_tcp(host, http_port, "--http-port") if http_port is not None else None
    try:
        bound = security.add_port(server, host, port)
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
