"""Where the weight pager's time and bytes go.

The pager and the page mover charge every phase of their work here: host seconds per
phase (plans, lowering, raise starts and commits, compaction, the whole boundary),
bytes copied each way (host -> device for raises and the new LUT of a lowering,
device -> device for compaction), and per block how often it went down and up (churn:
a block lowered and raised again paid a copy for nothing).

Seconds are host time (`time.perf_counter`): copies issued on a CUDA stream return at
once, so a boundary's device time shows in the step that follows it, not here. The
engine's own step time is the load's elapsed time; the profile says which part of it the
pager's Python and synchronous copies took.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("plan", "boundary", "lower", "raise_start", "raise_commit", "compact", "compact_for_raise")


@dataclass
class PagerProfile:
    seconds: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    calls: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    bytes_host_to_device: int = 0  # raise planes and LUTs, and the LUT a lowering brings in
    bytes_device_to_device: int = 0  # extents compaction relocated
    bytes_freed_by_lowering: int = 0  # planes and LUTs dropped (no copy)
    num_boundaries_with_work: int = 0  # boundaries that lowered, started, committed or compacted
    num_compaction_capped: int = 0  # compactions stopped by their per-boundary byte cap
    downs: dict = field(default_factory=lambda: defaultdict(int))  # block_id -> lowerings
    ups: dict = field(default_factory=lambda: defaultdict(int))  # block_id -> raises committed

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.calls[phase] += 1

    def churn(self) -> dict:
        """How often blocks went down and came back up (each such round trip copied planes
        that the next lowering dropped again)."""
        round_trips = [min(self.downs[b], self.ups.get(b, 0)) for b in self.downs]
        return {
            "blocks_lowered": len(self.downs),
            "blocks_raised": len(self.ups),
            "blocks_lowered_and_raised": sum(1 for n in round_trips if n),
            "round_trips": sum(round_trips),
            "max_lowerings_of_one_block": max(self.downs.values(), default=0),
        }

    def to_dict(self) -> dict:
        return {
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "calls": dict(self.calls),
            "bytes_host_to_device": self.bytes_host_to_device,
            "bytes_device_to_device": self.bytes_device_to_device,
            "bytes_freed_by_lowering": self.bytes_freed_by_lowering,
            "num_boundaries_with_work": self.num_boundaries_with_work,
            "num_compaction_capped": self.num_compaction_capped,
            "churn": self.churn(),
        }

    def reset(self) -> None:
        """Forget start-up loading (a load's profile starts from zero)."""
        self.__init__()
