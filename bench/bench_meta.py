"""What every benchmark result records: when, where, on which commit."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def commit() -> str:
    """HEAD (with -dirty for uncommitted changes); PAGEDWEIGHT_COMMIT where the tree is no
    git checkout (the GPU machine receives a copy of the working tree)."""
    if os.environ.get("PAGEDWEIGHT_COMMIT"):
        return os.environ["PAGEDWEIGHT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(name: str, payload: dict) -> Path:
    """Write bench/results/<name>.json with date, machine and commit added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "commit": commit(), **payload}
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
