"""Python's cyclic garbage collector, kept off the serving path.

A full (generation 2) collection walks every tracked object. A worker holds a few hundred
thousand of them after start-up (modules, the page table's extents and entries, the host
copies' wrappers): one full pass took 0.22-0.28 s on this repository's CPU machine with the
qwen-scaled pagedweight runtime held (docs/elasticity.md 2h). The collector starts one when
enough objects have survived younger passes, wherever the program is then. That fits the
one 0.29-0.43 s host stall per pagedweight trace of the H200 runs (in the scheduler or the
boundary, with no compile, allocation or copy in it), but is not confirmed: the CPU traces
made no full collection (2h).

`freeze_startup_heap` moves every object alive after start-up into the permanent generation
(`gc.freeze`): later collections walk only what serving created. Objects frozen are never
collected as cycles (reference counting still frees them); the worker freezes once its
warm-up is done (worker/server.py). `unfreeze` undoes it before a
deliberate `gc.collect()` (the benchmark between runtimes). `GCPauses` times every
collection, by generation, through `gc.callbacks` (for the benchmark's samples).
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    gc.unfreeze()


class GCPauses:
    """Seconds the collector ran, in all and in full (generation 2) collections, since
    `install`; `seconds` is cumulative, so callers diff it around a region."""

    def __init__(self):
        self.seconds = 0.0
        self.full_seconds = 0.0
        self.num_full = 0
        self._started = 0.0
        self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        self.seconds += elapsed
        if info.get("generation") == 2:
            self.full_seconds += elapsed
            self.num_full += 1

    def install(self) -> "GCPauses":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False
