"""What every benchmark result records (when, where, on which commit) and how it is written,
and what the benchmarks share: the checkout's path, their flags' parser, markdown rows, figures,
timing."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
# what a step profile splits a step into (step_components) and its table shows (tables)
STEP_COMPONENTS = ("attention", "gating", "shared expert", "routed experts", "norms", "embed + lm head",
                   "sampling", "other")


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's flags; its --help opens with the first line of `doc` (its docstring)."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout stays the result's."""
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    info = {"host": platform.node(), "cpu": names[0] if names else cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def device_tag() -> str:
    """A result-name suffix per machine kind: "cpu", "h100", "h200", ... so a run on one GPU
    does not overwrite another's."""
    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().lower().replace("nvidia", "").split()
    return words[0] if words else "cuda"


def commit() -> str:
    """HEAD (with -dirty for uncommitted changes); PAGEDWEIGHT_COMMIT where the tree is no
    git checkout (the GPU machine receives a copy of the working tree)."""
    if os.environ.get("PAGEDWEIGHT_COMMIT"):
        return os.environ["PAGEDWEIGHT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=REPO).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp() -> dict:
    """The fields every result opens with; results are kept per GPU (the newest of each)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)", "machine": machine()}


def write_result(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write bench/results/<name>_<device tag>.json (or `path`) with date, commit, GPU and
    machine added (the tag is left out where the name already ends with it)."""
    if path is None:
        tag = device_tag()
        path = RESULTS_DIR / (f"{name}.json" if name.endswith(tag) else f"{name}_{tag}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json({"benchmark": name, **stamp(), **payload}) + "\n")
    return path


def to_json(value, level: int = 0) -> str:
    """JSON indented by two spaces, except that a leaf stays on one line: a list of plain
    values (numbers, strings), or a dict of plain values and such lists. A per-chunk series or
    one cell of a table is one line, not one line per value."""
    pad, inner = "  " * level, "  " * (level + 1)
    if _is_leaf(value):
        return json.dumps(value)
    if isinstance(value, dict):
        # each key as json writes it (a non-string key becomes a string)
        items = [f"{inner}{json.dumps({k: None})[1:-7]}: {to_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + to_json(v, level + 1) for v in value) + "\n" + pad + "]"


def _is_plain(value) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _is_leaf(value) -> bool:
    if isinstance(value, dict):
        return all(_is_plain(v) or (isinstance(v, (list, tuple)) and all(map(_is_plain, v))) for v in value.values())
    return all(map(_is_plain, value)) if isinstance(value, (list, tuple)) else True


def md_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_header(*names) -> list[str]:
    """A markdown table's head: the names, then the rule."""
    return [md_row(*names), "|" + "---|" * len(names)]


def pyplot():
    """matplotlib's pyplot, drawing into files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def seconds(fn) -> float:
    """Wall seconds of one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def free_memory(device: torch.device) -> None:
    """What a closed runtime or a dropped model held, given back before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
