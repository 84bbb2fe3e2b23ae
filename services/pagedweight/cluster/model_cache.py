"""A served model directory: a paged model as given, or a checkpoint quantised once and cached.

The cache entry is named after the checkpoint's name and a digest of its config and
weight files (checkpoint_digest), so an edited checkpoint gets a fresh entry and a fresh
clone of the same one does not. Quantisation writes to a temporary sibling and renames it into place when done:
an interrupted first start leaves no half-written model that a later start would trust.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from pagedweight.common.errors import UserError
from pagedweight.common.paths import REPO_ROOT, corpus_dir

BUNDLED_CALIB = REPO_ROOT / "data" / "sample.txt"  # small: enough for a working micro model

DEFAULT_CACHE = Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight"))


def checkpoint_digest(model_dir: Path) -> str:
    """Content-based, cheap on big checkpoints: every JSON file whole, each safetensors
    file's size and first MiB (its header: tensor names, dtypes, shapes, offsets). A fresh
    clone or a copy (new modification times) reuses the cache entry; new weights do not."""
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix == ".json":
            h.update(f"{path.name}\n".encode() + path.read_bytes())
        elif path.is_file() and path.suffix == ".safetensors":
            with open(path, "rb") as f:
                h.update(f"{path.name}:{path.stat().st_size}\n".encode() + f.read(1 << 20))
    return h.hexdigest()[:12]


def default_calib_files() -> list[Path]:
    files = sorted(corpus_dir().glob("*.calib.txt"))
    return files or [BUNDLED_CALIB]


def paged_model_for(model_dir: str | Path, cache_dir: Path = DEFAULT_CACHE,
                    calib: list[Path] | None = None, log=print) -> Path:
    """The paged model directory to serve for `model_dir` (quantising it on first use)."""
    from pagedweight.format.paged_model import is_paged_model_dir

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"--model {model_dir}: not a directory")
    if is_paged_model_dir(model_dir):
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model {model_dir}: neither a paged model nor a checkpoint (no config.json)")
    target = Path(cache_dir) / f"{model_dir.resolve().name}-{checkpoint_digest(model_dir)}"
    if is_paged_model_dir(target):
        log(f"using the quantised model cached in {target}")
        return target
    from pagedweight.offline.calibrate import CalibConfig
    from pagedweight.offline.quantize import QuantizeConfig, quantize_model

    files = calib or default_calib_files()
    log(f"first start: quantising {model_dir} into {target} (calibration: {', '.join(f.name for f in files)}); "
        "later starts reuse it")
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    quantize_model(model_dir, partial, files, QuantizeConfig(calib=CalibConfig()),
                   lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        partial.rename(target)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(partial, ignore_errors=True)
    return target
