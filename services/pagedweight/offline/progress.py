"""A progress bar on stderr for the streaming quantiser: steps, layer, blocks, ETA.

On a terminal it redraws one line; elsewhere (a log file, a CI job) it prints a line per
update, so the log still shows how far a run got. The ETA is the mean time of the steps
this process ran times the steps left (steps a resumed run skipped cost nothing).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class ProgressBar:
    def __init__(self, total_steps: int, total_blocks: int, stream: TextIO | None = sys.stderr,
                 width: int = 24):
        self.total_steps, self.total_blocks = total_steps, total_blocks
        self.stream, self.width = stream, width
        self.steps = self.blocks = self.skipped = 0
        self.started = time.perf_counter()
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())

    def skip(self, blocks: int = 0) -> None:
        """A step done by an earlier run."""
        self.steps += 1
        self.skipped += 1
        self.blocks += blocks

    def advance(self, label: str, blocks: int = 0) -> None:
        self.steps += 1
        self.blocks += blocks
        self.show(label)

    def line(self, label: str) -> str:
        done = self.steps / max(self.total_steps, 1)
        filled = int(round(done * self.width))
        elapsed = time.perf_counter() - self.started
        ran = self.steps - self.skipped
        eta = _clock(elapsed / ran * (self.total_steps - self.steps)) if ran else "?"
        return (f"quantize [{'#' * filled}{'.' * (self.width - filled)}] {self.steps}/{self.total_steps} steps"
                f" | {label} | blocks {self.blocks}/{self.total_blocks}"
                f" | {_clock(elapsed)} elapsed, ETA {eta}")

    def show(self, label: str) -> None:
        if self.stream is None:
            return
        text = self.line(label)
        if self.tty:
            end = "\n" if self.steps >= self.total_steps else ""
            self.stream.write("\r\x1b[2K" + text + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
