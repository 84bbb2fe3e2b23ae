"""Writing a command's one output file: never over something it did not create, never half.

Written straight to the path given, `plan --out` or `plan-scales --out` pointed at a
model's `paged_model.json` or a shard (a typo, a tab completion) would destroy it, and a
crash mid-write would leave a truncated file. `write_output_file` refuses an existing path unless
`force`, refuses anything but a regular file there even with it, and writes a temporary
sibling that is fsync'ed and renamed over the path: readers see the old file or the new
one, never a mix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pagedweight.common.errors import UserError


def check_output_file(path: Path, force: bool, flag: str = "--out") -> None:
    """Fail before any work when `path` may not be written."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UserError(f"{flag} {path}: exists and is not a regular file")
    if path.exists() and not force:
        raise UserError(f"{flag} {path}: exists (pass --force to replace it)")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: directory {path.parent} is not writable")


def write_output_file(path: Path, text: str, force: bool, flag: str = "--out") -> None:
    check_output_file(path, force, flag)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"{flag} {path}: cannot write it ({err.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
