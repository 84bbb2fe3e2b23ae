"""The quantiser's own host memory, apart from the checkpoint's mapped pages.

`ru_maxrss` (the peak resident set) counts every page of the process that was resident,
including the safetensors files it reads through a memory map: quantising a checkpoint in
/dev/shm, or one the page cache keeps, reports about the checkpoint's size whatever the
quantiser holds. `RssAnon` (Linux, /proc/self/status) is the process's anonymous memory
only: tensors, activations, tables. The kernel keeps no peak of it, so `AnonymousPeak`
samples it where memory is highest between steps (after each step of the run) and keeps
the largest value seen: a lower bound on the true peak, exact for what outlives a step.
"""

from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")


def anonymous_bytes() -> int | None:
    """This process's resident anonymous memory now; None where /proc does not say (not Linux)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # "RssAnon:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


class AnonymousPeak:
    def __init__(self):
        self.peak: int | None = None

    def sample(self) -> None:
        now = anonymous_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now
