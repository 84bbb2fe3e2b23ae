"""An output directory that appears whole or not at all, and one writer at a time.

Written straight into DIR, `quantize --out DIR` would overwrite an existing checkpoint's
same-named files, an interrupted re-quantise would destroy the previous good artifact, and
two runs into one DIR would both report success over each other's files.
`atomic_output_dir` instead
1. refuses a non-empty DIR unless `force` (an empty one is replaced silently);
2. takes an exclusive lock on DIR's name (a `.DIR.lock` file beside it, flock'ed, so a
   crash releases it) -- a second writer fails at once instead of racing;
3. hands the caller a fresh temporary sibling `.DIR.tmp-*` to write into (same parent,
   so the final rename stays on one file system);
4. on success renames it into place (the old DIR, if forced, is moved aside first and
   removed after), on any failure or interrupt removes it: DIR is untouched.
A run killed by SIGKILL can leave a `.DIR.tmp-*` sibling behind; never a broken DIR.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from pagedweight.common.errors import UserError


def check_output_dir(out: Path, force: bool) -> None:
    """Fail before any work when DIR cannot be (re)placed."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out}: directory is not empty (pass --force to replace it)")
    parent = out.parent
    if not parent.is_dir():
        raise UserError(f"--out {out}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: parent directory {parent} is not writable")


@contextlib.contextmanager
def _exclusive_lock(out: Path) -> Iterator[None]:
    lock_path = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"--out {out}: another process is writing it (lock {lock_path})") from None
        # the previous holder may have removed the file between our open and our lock
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)  # while still held: a waiter re-checks the inode
        os.close(fd)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `out` (see the module doc)."""
    out = Path(out).absolute()
    check_output_dir(out, force)
    with _exclusive_lock(out):
        check_output_dir(out, force)  # again, now that no one else can change it
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            yield tmp
            _replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _replace(tmp: Path, out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old / out.name, out)  # put the previous artifact back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    os.chmod(out, 0o777 & ~_umask())  # mkdtemp makes 0700; give what mkdir would


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
