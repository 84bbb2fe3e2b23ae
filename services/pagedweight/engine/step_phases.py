"""Host seconds of each phase of an engine step: where a step's time goes.

At batch 1 a decode step's wall time is host work plus whatever of the device's work the
host waits for. The engine marks the end of each phase (`mark`): schedule, prepare (the
step's host rows and their upload, or the eager step's index tensors), signature (the
decode graphs' check that their captures still hold), launch (queueing the replay or the
eager forward), wait (reading the sampled tokens back: the step's one synchronisation,
which waits for the device), update (appending tokens, finishing sequences) and boundary
(the pager and the broker). A mark is one perf_counter call, so it is always on.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "prepare", "signature", "launch", "wait", "update", "boundary")


class StepPhases:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self._last = time.perf_counter()

    def start(self) -> None:
        """A step begins: time since the last mark (the caller's own work) is not counted."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The phase that just ended."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def end_step(self) -> None:
        self.num_steps += 1

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, averaged over the steps since `reset`."""
        n = max(1, self.num_steps)
        return {p: round(1000 * s / n, 4) for p, s in self.seconds.items()}
