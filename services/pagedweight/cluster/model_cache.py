"""A served model directory: a paged model as given, or a checkpoint quantised once and cached.

The cache entry is named after the checkpoint's name and a digest of the full content of
every file in it (checkpoint_digest), so an edited checkpoint (any byte of any file) gets a
fresh entry and a fresh clone of the same one does not. Each file is hashed whole, streamed;
the digests are remembered by (size, mtime, inode) in the cache folder, so a restart with
an unchanged checkpoint does not read its gigabytes again. Quantisation writes to a temporary sibling and renames it into place when done:
an interrupted first start leaves no half-written model that a later start would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from pagedweight.common.errors import UserError
from pagedweight.common.file_digest import file_sha256
from pagedweight.common.paths import REPO_ROOT, corpus_dir
from pagedweight.common.safe_paths import model_file

BUNDLED_CALIB = REPO_ROOT / "data" / "sample.txt"  # small: enough for a working micro model

DEFAULT_CACHE = Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight"))


DIGESTS_FILE = "file-digests.json"  # path -> {"stat": [size, mtime_ns, inode], "sha256"}


def checkpoint_digest(model_dir: Path, cache_dir: Path | None = None) -> str:
    """sha256 over every regular file's name and full-content sha256 (sorted by name; a
    symlink that leaves the directory is refused, so nothing outside is read or recorded);
    with `cache_dir`, per-file digests are reused while a file's size, mtime and inode
    are unchanged (a copy or a rewrite changes one of them and is hashed again)."""
    known = _read_digests(cache_dir)
    h, changed = hashlib.sha256(), False
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    for name in names:
        path = model_file(model_dir, name, UserError)  # a symlink out of the directory is refused
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(path.resolve())
        record = known.get(key)
        if not (isinstance(record, dict) and record.get("stat") == stamp and isinstance(record.get("sha256"), str)):
            record = known[key] = {"stat": stamp, "sha256": file_sha256(path)}
            changed = True
        h.update(f"{path.name}\0{record['sha256']}\n".encode("utf-8", "surrogateescape"))
    if changed and cache_dir is not None:
        _write_digests(cache_dir, known)
    return h.hexdigest()[:16]


def _read_digests(cache_dir: Path | None) -> dict:
    if cache_dir is None:
        return {}
    try:
        data = json.loads((Path(cache_dir) / DIGESTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: everything is hashed again
    return data if isinstance(data, dict) else {}


def _write_digests(cache_dir: Path, known: dict) -> None:
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(cache_dir) / f".{DIGESTS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(known), encoding="utf-8")
        os.replace(tmp, Path(cache_dir) / DIGESTS_FILE)
    except OSError:
        pass  # only a speed-up: the next start hashes again


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
    target = Path(cache_dir) / f"{model_dir.resolve().name}-{checkpoint_digest(model_dir, Path(cache_dir))}"
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
