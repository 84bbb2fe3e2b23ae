"""The streaming quantiser's work directory: what lets a run resume after interruption.

Every step of a run (the embedding, each layer's forward, the loss, each layer's
backward) writes its outputs as safetensors files here and then marks itself done in
`manifest.json`; a later run with the same inputs skips what is done and goes on, so a
quantisation can span several commands (a GPU lease of ten minutes each, say). Files
and manifest are replaced by write-to-temporary-then-rename, so a kill at any moment
leaves the last completed step intact.

The manifest records the run's fingerprint (model files, calibration files, every
setting that changes a number); a run whose fingerprint differs refuses to resume
rather than mix two runs' layers. The directory is untrusted on resume like any input
file: the manifest must parse into the expected shape, file names must be the ones this
module writes, and each file's size and sha256 must match what the manifest recorded
(files this process wrote itself, under the lock, are checked by size only: their digest
was taken from the bytes just written, and re-reading ~1 GB per layer to hash it again
cost about a second a layer at Qwen1.5-MoE-A2.7B's shape).
An exclusive lock (flock on `.lock`, released by the kernel when a process dies) keeps a
second run out while one is writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pagedweight.common.errors import UserError
from pagedweight.common.file_digest import file_sha256

MANIFEST = "manifest.json"
FORMAT = "pagedweight-quantize-work"
VERSION = 2  # 2: planes and LUTs in planes{l}, apart from layer{l}'s tables
_FILE_NAME = re.compile(r"^[a-z]+[0-9]*$")  # the names quantize.py uses: x3, dx4, layer0, gn2, embed
_WORK_FILE = re.compile(r"^[a-z]+[0-9]*\.safetensors(\.tmp)?$")


class WorkDir:
    """Use as a context manager: takes the lock, reads or starts the manifest."""

    def __init__(self, path: str | Path, fingerprint: dict, restart: bool = False):
        self.path = Path(path).absolute()
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as the manifest will hold it
        self.restart = restart
        self._lock_fd: int | None = None
        self.steps: list[str] = []
        self.files: dict[str, dict] = {}
        self.resumed_steps = 0
        self._written: set[str] = set()  # names this instance committed (their digests are its own)

    def __enter__(self) -> "WorkDir":
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--work-dir {self.path}: exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise UserError(f"--work-dir {self.path}: another quantize run is using it") from None
        try:
            if self.restart:
                self._clear()
            self._read_manifest()
        except BaseException:
            self.__exit__()  # a refused directory must not stay locked by this process
            raise
        self.resumed_steps = len(self.steps)
        return self

    def __exit__(self, *exc) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _ours(self) -> list[Path]:
        """Entries this module writes: the manifest, work files and their temporaries."""
        return [e for e in self.path.iterdir() if e.is_file() and not e.is_symlink() and (
            e.name in (MANIFEST, MANIFEST + ".tmp") or _WORK_FILE.match(e.name))]

    def _clear(self) -> None:
        """--restart: remove what a run wrote; anything else there is not ours to delete."""
        for entry in self._ours():
            entry.unlink()
        others = sorted(e.name for e in self.path.iterdir() if e.name != ".lock")
        if others:
            raise UserError(f"--work-dir {self.path}: holds files no quantize run wrote ({', '.join(others[:3])}"
                            f"{', ...' if len(others) > 3 else ''}); they are left alone: choose another "
                            f"directory")

    def _read_manifest(self) -> None:
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            if any(e.name != ".lock" for e in self.path.iterdir()):
                raise UserError(f"--work-dir {self.path}: not empty and has no {MANIFEST} "
                                f"(pass --restart to clear it, or choose another directory)")
            self._write_manifest()
            return
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{manifest}: unreadable work manifest ({err}); pass --restart") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION \
                or not isinstance(data.get("steps"), list) or not isinstance(data.get("files"), dict) \
                or not all(isinstance(s, str) for s in data["steps"]) \
                or not all(_FILE_NAME.match(str(k)) and isinstance(v, dict) and isinstance(v.get("bytes"), int)
                           and isinstance(v.get("sha256"), str) for k, v in data["files"].items()):
            raise UserError(f"{manifest}: not a {FORMAT} v{VERSION} manifest; pass --restart")
        if data.get("run") != self.fingerprint:
            differ = sorted(k for k in set(self.fingerprint) | set(data.get("run") or {})
                            if (data.get("run") or {}).get(k) != self.fingerprint.get(k))
            raise UserError(f"--work-dir {self.path}: holds a run with other inputs ({', '.join(differ)} "
                            f"differ); pass --restart to discard it, or choose another --work-dir")
        self.steps, self.files = list(data["steps"]), dict(data["files"])

    def _write_manifest(self) -> None:
        data = {"format": FORMAT, "version": VERSION, "run": self.fingerprint,
                "steps": self.steps, "files": self.files}
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path / MANIFEST)

    def done(self, step: str) -> bool:
        return step in self.steps

    def commit(self, step: str, outputs: dict[str, dict[str, torch.Tensor]]) -> None:
        """Write every output file (name -> tensors), then record `step` as done."""
        for name, tensors in outputs.items():
            if not _FILE_NAME.match(name):
                raise ValueError(f"work file name {name!r}")
            path = self.path / f"{name}.safetensors"
            tmp = self.path / f"{name}.safetensors.tmp"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, path)
            self.files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            self._written.add(name)
        self.steps.append(step)
        self._write_manifest()

    def load(self, name: str) -> dict[str, torch.Tensor]:
        """A file some completed step wrote, checked against the manifest's record."""
        record = self.files.get(name)
        path = self.path / f"{name}.safetensors"
        if record is None:
            raise UserError(f"--work-dir {self.path}: {name} is missing from the manifest; pass --restart")
        if not path.is_file() or path.stat().st_size != record["bytes"] or (
                name not in self._written and file_sha256(path) != record["sha256"]):
            raise UserError(f"{path}: missing, truncated or changed since it was written; pass --restart")
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path}: unreadable ({err}); pass --restart") from None

    def discard(self, *names: str) -> None:
        """Drop files no later step reads (activations already consumed)."""
        for name in names:
            if self.files.pop(name, None) is not None:
                (self.path / f"{name}.safetensors").unlink(missing_ok=True)
        self._write_manifest()

    def forget(self, steps: list[str], names: list[str]) -> None:
        """Undo steps whose inputs changed (the loss scales' token count): they run again."""
        self.steps = [s for s in self.steps if s not in steps]
        self.discard(*names)

    def remove(self) -> None:
        """Delete what runs wrote and the directory when that leaves it empty (after the
        artifact is complete); nothing else, whatever the directory holds."""
        for entry in self._ours():
            entry.unlink(missing_ok=True)
        (self.path / ".lock").unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:
            pass
