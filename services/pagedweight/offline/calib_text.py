"""The calibration text shipped inside the package, and the record of what was used.

`pagedweight quantize` without `--calib` calibrates on the four small files in
calib_text/ (prose, code, docs, technical; sources and licenses in calib_text/README.md).
Whatever text was used, the artifact records it by name and sha256 so that two paged
models can be told apart by their calibration, not only by their weights.
Torch-free: the CLI resolves the files before it imports the quantiser.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from pagedweight.common.file_digest import file_sha256

BUNDLED_VERSION = "v1"  # bump when the bundled files change: the name travels in artifacts
BUNDLED_NAME = f"bundled:{BUNDLED_VERSION}"
USER_NAME = "user"
_SUFFIX = ".calib.txt"


def bundled_calib_files() -> list[Path]:
    """The bundled calibration files, one per domain, sorted by name."""
    root = resources.files("pagedweight.offline") / "calib_text"
    files = sorted(Path(str(f)) for f in root.iterdir() if f.name.endswith(_SUFFIX))
    if not files:  # a broken install, not a user error: say where we looked
        raise FileNotFoundError(f"no *{_SUFFIX} files in {root}: the package data is missing")
    return files


def calib_text_record(files: list[Path], name: str) -> dict:
    """{"name", "files": [{"name", "num_bytes", "sha256"}]}: what paged_model.json records."""
    return {"name": name,
            "files": [{"name": Path(f).name, "num_bytes": Path(f).stat().st_size, "sha256": file_sha256(Path(f))}
                      for f in files]}
