"""What every benchmark result records: when, where, on which commit."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout stays the result's."""
    print(msg, file=sys.stderr, flush=True)


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


def gpu() -> str:
    """The GPU's name, or "none (CPU)": results are kept per GPU (the newest of each)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"


def device_tag() -> str:
    """A result-name suffix per machine kind: "cpu", "h100", "h200", ... so a run on one GPU
    does not overwrite another's."""
    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().lower().replace("nvidia", "").split()
    return words[0] if words else "cuda"


def stamp() -> dict:
    """The fields every result opens with."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "gpu": gpu(), "machine": machine()}


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
    """Write bench/results/<name>_<device tag>.json with date, commit, GPU and machine added
    (the tag is left out where the name already ends with it)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, **stamp(), **payload}
    tag = device_tag()
    path = RESULTS_DIR / (f"{name}.json" if name.endswith(tag) else f"{name}_{tag}.json")
    path.write_text(to_json(record) + "\n")
    return path


def to_json(value, level: int = 0) -> str:
    """JSON indented by two spaces, except that a leaf stays on one line: a list of plain
    values (numbers, strings), or a dict of plain values and such lists. A per-chunk series or
    one cell of a table is one line, not one line per value."""
    pad, inner = "  " * level, "  " * (level + 1)
    if _is_leaf(value):
        return json.dumps(value)
    if isinstance(value, dict):
        items = [f"{inner}{_key(k)}: {to_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + to_json(v, level + 1) for v in value) + "\n" + pad + "]"


def _is_plain(value) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _is_leaf(value) -> bool:
    if isinstance(value, dict):
        return all(_is_plain(v) or (isinstance(v, (list, tuple)) and all(map(_is_plain, v)))
                   for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(map(_is_plain, value))
    return True


def _key(key) -> str:
    """A dict key as json.dumps writes it (non-string keys become strings)."""
    return json.dumps({key: None})[1:-7]
