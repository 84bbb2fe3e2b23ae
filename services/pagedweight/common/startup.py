"""Where a service's start-up is: phase, percent, ETA, in its log and in its health answers.

A start is a fixed list of phases, each with its expected share of the time (loading a
large model is minutes of reading, placing and compiling; an operator should see which and
how far). `begin(phase)` logs the phase with the percent done so far; a thread logs a line
every `log_every_s` while a phase lasts, so a long phase is never silence. The percent
counts finished phases by their shares; the ETA scales the time spent so far by the share
still to come (rough on the first phases, better as the start goes on).
"""

from __future__ import annotations

import logging
import threading
import time


class StartupProgress:
    def __init__(self, service: str, phases: dict[str, float], log: logging.Logger,
                 log_every_s: float = 10.0):
        total = sum(phases.values())
        self.service, self.log = service, log
        self.shares = {name: share / total for name, share in phases.items()}  # phase -> share of 1
        self.started = time.monotonic()
        self.phase: str | None = None
        self.done_share = 0.0  # shares of the phases finished
        self.ready_after_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, args=(log_every_s,), daemon=True,
                                        name=f"{service}-startup")
        self._thread.start()

    def begin(self, phase: str) -> None:
        if self.phase is not None:
            self.done_share += self.shares.get(self.phase, 0.0)
        self.phase = phase
        self.log.info("%s starting: %s", self.service, self.describe())

    def ready(self) -> None:
        self.done_share, self.phase = 1.0, None
        self.ready_after_s = time.monotonic() - self.started
        self._stop.set()

    def close(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict:
        """For /health: {"status", "phase", "percent", "elapsed_s", "eta_s"}."""
        elapsed = time.monotonic() - self.started
        if self.ready_after_s is not None:
            return {"status": "ready", "phase": "ready", "percent": 100.0,
                    "elapsed_s": round(self.ready_after_s, 1), "eta_s": 0.0}
        done = self.done_share
        eta = elapsed * (1 - done) / done if done > 0 else None
        return {"status": "starting", "phase": self.phase or "starting", "percent": round(100 * done, 1),
                "elapsed_s": round(elapsed, 1), "eta_s": round(eta, 1) if eta is not None else None}

    def describe(self) -> str:
        s = self.snapshot()
        eta = f", about {s['eta_s']:.0f} s to go" if s["eta_s"] is not None else ""
        return f"{s['phase']} ({s['percent']:.0f}% after {s['elapsed_s']:.0f} s{eta})"

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.log.info("%s still starting: %s", self.service, self.describe())
