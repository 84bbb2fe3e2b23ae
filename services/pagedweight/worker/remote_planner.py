"""The planner service behind the weight pager's `BitPlanner`, with the in-process planner
as its fallback.

`submit` sends the request as one `Plan` RPC (a future with a deadline) and returns at
once; `poll` hands the pager the answer when it has arrived and passed the plan contract
(planner_messages.response_from_proto: known blocks, bits 3..8, a free never raises, a
spend never lowers nor overspends). If the service misses the deadline, is down, forgot
us (NOT_FOUND after its restart) or answers garbage, the in-process planner answers the
same request instead, so the worker keeps serving on its own plans, and a background
thread re-registers with exponential backoff. Every transition is logged and counted.

A worker that needs no plan would only learn of a planner restart at its next plan, and
until then report itself connected to a service that has never heard of it. So the
channel's connectivity is watched too: when a registered worker's connection leaves
READY (the service went away, or restarted), the registration counts as lost and the
worker registers again as soon as the service answers.

The in-process planner sees every request's routing snapshot (also those the service
answers), so its moving average is current when it has to step in.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc

from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.planner.messages import PlannerRegistration, PlanRequest, PlanResponse
from pagedweight.rpc import planner_messages, planner_pb2_grpc

log = logging.getLogger("pagedweight.worker.planner")


class RemotePlanner:
    def __init__(self, address: str, local, worker_id: str, model_name: str, policy: str,
                 deadline_s: float = 0.25, backoff_s: tuple[float, float] = (0.2, 10.0), metrics=None,
                 security: RpcSecurity | None = None):
        self.address, self.local = address, local  # local: InProcessPlanner, registered or not
        self.worker_id, self.model_name, self.policy = worker_id, model_name, policy
        self.deadline_s, (self.backoff_min, self.backoff_max) = deadline_s, backoff_s
        self.metrics = metrics  # common.metrics.WorkerMetrics or None
        self.registration: PlannerRegistration | None = None
        self._registration_id: str | None = None  # set while registered with the service
        self._pending = None  # (request, grpc future, started) of the request at the service
        self._wake = threading.Event()
        self._stopped = False
        self.num_service_plans = self.num_local_plans = self.num_reconnects = 0
        security = security or RpcSecurity()
        self._metadata = security.metadata()  # the RPC token, when the service requires one
        self._channel = security.sync_channel(address)
        self._stub = planner_pb2_grpc.PlannerStub(self._channel)
        self._thread: threading.Thread | None = None
        self._channel_state = None  # the channel's last connectivity state

    # ---- BitPlanner ----------------------------------------------------------------------
    def register(self, registration: PlannerRegistration) -> None:
        self.registration = registration
        if self.local.table is None:
            self.local.register(registration)
        self._register_msg = planner_messages.registration_to_proto(
            registration, self.worker_id, self.model_name, self.policy,
            scales=self.local.scales, move_cost=self.local.move_cost)
        if self._thread is None:
            self._thread = threading.Thread(target=self._reconnect_loop, daemon=True, name="planner-reconnect")
            self._thread.start()
            self._channel.subscribe(self._on_channel_state, try_to_connect=True)

    def initial_bits(self, budget: int):
        return self.local.initial_bits(budget)  # blocking by nature: the weights wait for it

    def submit(self, request: PlanRequest) -> None:
        registration_id = self._registration_id
        if registration_id is None:
            self._answer_locally(request)
            return
        self._observe_locally(request)
        message = planner_messages.request_to_proto(request, self.registration, self.worker_id, registration_id)
        self._pending = (request, self._stub.Plan.future(message, timeout=self.deadline_s,
                                                                  metadata=self._metadata), time.perf_counter())

    def poll(self) -> PlanResponse | None:
        if self._pending is not None and self._pending[1].done():
            request, future, started = self._pending
            self._pending = None
            try:
                response = planner_messages.response_from_proto(future.result(), request, self.registration)
            except grpc.RpcError as err:
                self._lost(_reason(err), f"{err.code().name}: {err.details()}")
            except ValueError as err:
                self._lost("garbage", str(err))
            else:
                self.num_service_plans += 1
                self._observe_latency("service", started)
                return response
            self._answer_locally(request, observed=True)
        return self.local.poll()

    @property
    def connected(self) -> bool:
        return self._registration_id is not None

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._channel.unsubscribe(self._on_channel_state)
        self._channel.close()

    # ---- the in-process side -------------------------------------------------------------
    def _observe_locally(self, request: PlanRequest) -> None:
        """Keep the local moving average and prompt context current while the service answers."""
        local = self.local
        local.observe_prompts(request)
        if request.routing is None:
            return
        for layer, num_tokens in enumerate(request.routing.num_tokens.tolist()):
            local.stats.observe_counts(layer, request.routing.counts[layer], request.routing.mass[layer],
                                       int(num_tokens))
        local.context.relative_mass = local.stats.relative_mass()

    def _answer_locally(self, request: PlanRequest, observed: bool = False) -> None:
        started = time.perf_counter()
        if observed and request.routing is not None:  # already in the average: do not count it twice
            request = dataclasses.replace(request, routing=None)
        self.local.submit(request)
        self.num_local_plans += 1
        self._observe_latency("local", started)

    def _observe_latency(self, source: str, started: float) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.plans[source].inc()
            m.plan_latency.labels(source=source, **m._labels).observe(time.perf_counter() - started)

    # ---- connection ----------------------------------------------------------------------
    def _lost(self, reason: str, detail: str) -> None:
        if self._registration_id is not None:
            log.warning("planner service %s failed (%s: %s); using the in-process planner, reconnecting",
                        self.address, reason, detail)
        self._registration_id = None
        if self.metrics is not None:
            self.metrics.planner_error(reason)
            self.metrics.planner_connected.set(0)
        self._wake.set()

    def _on_channel_state(self, state: grpc.ChannelConnectivity) -> None:
        """gRPC's callback thread: a connection that drops may have been to a service that
        is now gone or restarted without our registration."""
        was, self._channel_state = self._channel_state, state
        if was == grpc.ChannelConnectivity.READY and state != was and not self._stopped:
            self._lost("unavailable", f"connection {state.name.lower()}")

    def _reconnect_loop(self) -> None:
        backoff, first = self.backoff_min, True
        while not self._stopped:
            if self._registration_id is not None:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                response = self._stub.Register(self._register_msg, timeout=max(self.deadline_s, 2.0),
                                               metadata=self._metadata)
            except grpc.RpcError as err:
                if first or backoff >= self.backoff_max:
                    log.warning("planner service %s unreachable (%s); retrying in %.1fs",
                                self.address, err.code().name, backoff)
                first = False
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, self.backoff_max)
                continue
            self._registration_id = response.registration_id
            backoff = self.backoff_min
            if self.metrics is not None:
                self.metrics.planner_connected.set(1)
            if not first:
                self.num_reconnects += 1
                if self.metrics is not None:
                    self.metrics.planner_reconnects.inc()
            log.info("registered with the planner service %s (%d blocks)%s", self.address,
                     response.num_blocks, "" if first else " again")
            first = False


def _reason(err: grpc.RpcError) -> str:
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
            grpc.StatusCode.NOT_FOUND: "not_registered"}.get(err.code(), "other")
