"""The planner service behind the weight pager's BitPlanner calls, with a local fallback.

The pager calls `plan_free(bits, n)` / `plan_spend(bits, n)` from the engine's thread
between steps. While registered with the planner service, each call becomes one `Plan`
RPC with a deadline; the answer is checked (known blocks, bits 3..8, a free never
raises, a spend never lowers nor overspends) before the pager sees it. If the service is
slow, down, forgot us, or answers garbage, the in-process planner answers the same call
(the worker keeps serving on its own plan) and a background thread re-registers with
exponential backoff; every transition is logged and counted in the metrics.

Routing reaches the service as windows: `capture_window` runs before each plan (the
RoutingFeed's refresh also keeps the local planner current); windows not yet delivered
add up until a call succeeds, so an outage loses no routing.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np

from pagedweight.format.apl_format import BIT_WIDTHS, BlockId
from pagedweight.rpc import planner_pb2, planner_pb2_grpc

log = logging.getLogger("pagedweight.worker.planner")


class PlanRejected(Exception):
    """The service's answer broke the plan contract (a bug or version skew there)."""


def register_request(worker_id: str, model_name: str, policy: str, local, top_k: int):
    """The RegisterRequest of a worker whose in-process planner is `local` (PolicyPlanner):
    the same block table, in arena bytes."""
    t = local.table
    blocks = [planner_pb2.BlockInfo(block_id=b.key(), bytes_by_bits=[int(x) for x in t.nbytes[i]],
                                    sensitivity=[float(x) for x in t.sensitivity[i]])
              for i, b in enumerate(t.block_ids)]

    def array(values):
        return planner_pb2.ExpertArray(values=[] if values is None else np.asarray(values).ravel().tolist())

    return planner_pb2.RegisterRequest(
        worker_id=worker_id, model_name=model_name, policy=policy, blocks=blocks,
        num_layers=t.num_layers, num_experts=t.num_experts, top_k=top_k,
        calib_mass=array(t.calib_mass), calib_share=array(t.calib_share))


class RemotePlanner:
    def __init__(self, address: str, local, register: planner_pb2.RegisterRequest,
                 deadline_s: float = 0.25, backoff_s: tuple[float, float] = (0.2, 10.0), metrics=None):
        self.address, self.local, self.register_msg = address, local, register
        self.deadline_s, (self.backoff_min, self.backoff_max) = deadline_s, backoff_s
        self.metrics = metrics  # common.metrics.WorkerMetrics or None
        self.context = local.context  # the RoutingFeed writes the local planner's context
        t = local.table
        self._index = {b: i for i, b in enumerate(t.block_ids)}  # BlockId -> table row
        self._nbytes = t.nbytes
        shape = (t.num_layers, t.num_experts)
        self._counts, self._mass = np.zeros(shape), np.zeros(shape)  # undelivered routing
        self._tokens = np.zeros(t.num_layers, dtype=np.int64)
        self._lock = threading.Lock()
        self._registration: str | None = None  # registration id while registered
        self._wake = threading.Event()
        self._stopped = False
        self.num_service_plans = self.num_local_plans = self.num_reconnects = 0
        self._channel = grpc.insecure_channel(address)
        self._stub = planner_pb2_grpc.PlannerStub(self._channel)
        self._thread = threading.Thread(target=self._reconnect_loop, daemon=True, name="planner-reconnect")
        self._thread.start()

    # ---- BitPlanner ----------------------------------------------------------------------
    def plan_free(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        return self._plan(planner_pb2.PlanRequest.FREE, bits, num_bytes)

    def plan_spend(self, bits: dict[BlockId, int], num_bytes: int) -> dict[BlockId, int]:
        return self._plan(planner_pb2.PlanRequest.SPEND, bits, num_bytes)

    def initial_bits(self, budget: int) -> dict[BlockId, int]:
        return self.local.initial_bits(budget)

    @property
    def connected(self) -> bool:
        return self._registration is not None

    def capture_window(self, counts, mass, num_tokens) -> None:
        """Add one routing window ([L, E], [L, E], [L]) to what the service has not seen."""
        self._counts += counts
        self._mass += mass
        self._tokens += np.asarray(num_tokens, dtype=np.int64)

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._channel.close()

    # ---- one plan ------------------------------------------------------------------------
    def _plan(self, direction, bits, num_bytes):
        registration = self._registration
        if registration is not None:
            started = time.perf_counter()
            try:
                changes = self._ask(registration, direction, bits, num_bytes)
            except grpc.RpcError as err:
                self._lost(_reason(err), f"{err.code().name}: {err.details()}")
            except PlanRejected as err:
                self._lost("garbage", str(err))
            else:
                self.num_service_plans += 1
                self._observe("service", started)
                return changes
        started = time.perf_counter()
        plan = (self.local.plan_free if direction == planner_pb2.PlanRequest.FREE else self.local.plan_spend)(
            bits, num_bytes)
        self.num_local_plans += 1
        self._observe("local", started)
        return plan

    def _ask(self, registration, direction, bits, num_bytes):
        routing = planner_pb2.RoutingWindow(counts=self._counts.ravel().tolist(),
                                            mass=self._mass.ravel().tolist(), num_tokens=self._tokens.tolist())
        request = planner_pb2.PlanRequest(
            worker_id=self.register_msg.worker_id, registration_id=registration, direction=direction,
            num_bytes=int(num_bytes), bits={b.key(): int(v) for b, v in bits.items()}, routing=routing)
        response = self._stub.Plan(request, timeout=self.deadline_s)
        self._counts[:] = 0  # delivered
        self._mass[:] = 0
        self._tokens[:] = 0
        return self._checked(response, direction, bits, num_bytes)

    def _checked(self, response, direction, bits, num_bytes) -> dict[BlockId, int]:
        changes, delta = {}, 0
        for key, new in response.changes.items():
            try:
                block = BlockId.parse(key)
            except ValueError:
                raise PlanRejected(f"plan {response.plan_id}: bad block key {key!r}") from None
            if block not in bits or new not in BIT_WIDTHS:
                raise PlanRejected(f"plan {response.plan_id}: block {key} -> {new} bits is not a valid change")
            old = bits[block]
            if (direction == planner_pb2.PlanRequest.FREE and new > old) or (
                    direction == planner_pb2.PlanRequest.SPEND and new < old):
                raise PlanRejected(f"plan {response.plan_id}: block {key} {old} -> {new} goes the wrong way")
            row = self._nbytes[self._index[block]]
            delta += int(row[new - BIT_WIDTHS[0]] - row[old - BIT_WIDTHS[0]])
            changes[block] = int(new)
        if direction == planner_pb2.PlanRequest.SPEND and delta > num_bytes:
            raise PlanRejected(f"plan {response.plan_id}: spends {delta} bytes, {num_bytes} offered")
        return changes

    def _observe(self, source: str, started: float) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.plans[source].inc()
            m.plan_latency.labels(source=source, **m._labels).observe(time.perf_counter() - started)

    # ---- connection ----------------------------------------------------------------------
    def _lost(self, reason: str, detail: str) -> None:
        if self._registration is not None:
            log.warning("planner service %s failed (%s: %s); using the in-process planner, reconnecting",
                        self.address, reason, detail)
        self._registration = None
        if self.metrics is not None:
            self.metrics.planner_error(reason)
            self.metrics.planner_connected.set(0)
        self._wake.set()

    def _reconnect_loop(self) -> None:
        backoff, first = self.backoff_min, True
        while not self._stopped:
            if self._registration is not None:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                response = self._stub.Register(self.register_msg, timeout=max(self.deadline_s, 2.0))
            except grpc.RpcError as err:
                if first or backoff >= self.backoff_max:
                    log.warning("planner service %s unreachable (%s); retrying in %.1fs",
                                self.address, err.code().name, backoff)
                first = False
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, self.backoff_max)
                continue
            self._registration = response.registration_id
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
