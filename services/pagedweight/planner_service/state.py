"""One registered worker as the planner service keeps it: its registration and planner.

The service runs the same `InProcessPlanner` a worker runs in process (the planner
library's policies, its routing moving average, the online planner's hysteresis), fed
from the wire: so a plan from the service and one from a worker's fallback differ only
by the routing each has seen.
"""

from __future__ import annotations

import threading
import uuid

from pagedweight.common.errors import UserError
from pagedweight.planner.dial import OperatorDial
from pagedweight.planner.messages import PlanResponse
from pagedweight.rpc import planner_messages, planner_pb2
from pagedweight.planner.in_process_planner import InProcessPlanner


class WorkerPlanState:
    def __init__(self, request: planner_pb2.RegisterRequest):
        if not request.worker_id:
            raise UserError("worker_id must not be empty")
        if not request.blocks:
            raise UserError("a worker must register at least one block")
        try:
            self.registration = planner_messages.registration_from_proto(request)
            # the worker's own scales and move cost: the service plans as its fallback would
            self.planner = InProcessPlanner(request.policy or "pagedweight", planner_messages.scales_from_proto(request),
                                            move_cost=request.move_cost)
            self.planner.register(self.registration)
        except ValueError as err:  # ragged arrays, bad keys, shapes, unknown policy
            raise UserError(f"bad registration: {err}") from None
        self.worker_id = request.worker_id
        self.policy_name = request.policy or "pagedweight"
        self.registration_id = uuid.uuid4().hex
        self._num_requests = 0
        self._lock = threading.Lock()  # plans run in threads; one worker's plans run in order

    @property
    def num_blocks(self) -> int:
        return len(self.registration.block_keys)

    def plan(self, message: planner_pb2.PlanRequest, dial: OperatorDial = OperatorDial()) -> PlanResponse:
        """The plan for one request under the service's dial (held by the servicer)."""
        with self._lock:
            self.planner.dial = dial
            self._num_requests += 1
            try:
                request = planner_messages.request_from_proto(message, self.registration, self._num_requests)
            except ValueError as err:
                raise UserError(str(err)) from None
            self.planner.submit(request)
            return self.planner.poll()  # the in-process planner answers at once
