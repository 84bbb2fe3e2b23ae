"""Paths read from files (a shard index, a paged model's manifest) are untrusted.

A name such as `../../etc/passwd`, `/etc/passwd` or a symlink pointing out of the model
directory would let a model directory make the loader open (and report the size of)
any file the user can read. `inside_dir` accepts only names that resolve to a file
inside the directory; `model_file` also wants a regular file, so a FIFO named like a
weight file cannot hang a reader and a device cannot be read as one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from pagedweight.common.errors import CheckpointError


def inside_dir(base: str | Path, name: object, error: type[Exception] = CheckpointError) -> Path:
    """`base / name`, or `error` when `name` is not a relative path that stays in `base`."""
    base = Path(base)
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise error(f"{base}: file name {repr(name)[:80]} is not a plain relative path")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise error(f"{base}: file name {name[:80]!r} points outside the model directory")
    path = base / name
    try:
        resolved, root = path.resolve(), base.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop
        raise error(f"{base}: file name {name[:80]!r} cannot be resolved ({err})") from None
    if not resolved.is_relative_to(root):
        raise error(f"{base}: file {name[:80]!r} resolves outside the model directory")
    return path


def model_file(base: str | Path, name: str, error: type[Exception] = CheckpointError) -> Path | None:
    """`base / name` when it is a regular file inside `base`; None when there is no entry of
    that name; `error` when it resolves outside `base` (a symlink out), or is a FIFO, a
    device, a directory or a dangling link."""
    path = inside_dir(base, name, error)
    if not os.path.lexists(path):
        return None
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file")
    return path
