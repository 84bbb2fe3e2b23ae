"""What the weight pager needs from a bit planner: register once, then requests and responses.

The planner may live in the worker's process (in_process_planner.InProcessPlanner, over
the planner library's policies) or in another service (a gRPC client implementing the
same four calls). The messages are planner/messages.py's plain dataclasses; no call hands
the planner a reference into the worker's state.

Timing: `submit` never blocks on planning and `poll` never waits. The pager submits a
request when KV pressure changes (between forward steps) and applies a response whenever
`poll` returns one, at that step boundary or a later one. An in-process planner answers
at once; a remote one a few steps later. The pager keeps at most one request in flight.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedweight.planner.messages import PlannerRegistration, PlanRequest, PlanResponse


class BitPlanner(Protocol):
    def register(self, registration: PlannerRegistration) -> None:
        """The worker's block table; every later array follows its block order."""

    def initial_bits(self, budget: int) -> np.ndarray:
        """int64 [N]: the starting plan within `budget` arena bytes (blocking: the worker
        cannot load its weights without it)."""

    def submit(self, request: PlanRequest) -> None:
        """Queue a request; its response comes from a later `poll`."""

    def poll(self) -> PlanResponse | None:
        """The next finished response, or None if none is ready yet."""
