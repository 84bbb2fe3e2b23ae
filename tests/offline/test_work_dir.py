"""WorkDir's checks on load: a file this instance wrote is checked by its size (its digest
was taken from the bytes just written); one from an earlier run, by size and sha256."""

from __future__ import annotations

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.offline.work_dir import WorkDir


def test_own_writes_are_checked_by_size_and_a_resumed_run_by_digest(tmp_path):
    x = torch.arange(64, dtype=torch.float32)
    with WorkDir(tmp_path / "w", {"run": 1}) as work:
        work.commit("forward0", {"x1": {"x": x}})
        path = work.path / "x1.safetensors"
        data = path.read_bytes()
        path.write_bytes(data[:-4] + b"\0\0\0\0")  # same size, other bytes: not re-hashed here
        assert not torch.equal(work.load("x1")["x"], x)
        path.write_bytes(data[:-4])  # a truncated file is refused even here
        with pytest.raises(UserError, match="truncated or changed"):
            work.load("x1")
        path.write_bytes(data[:-4] + b"\0\0\0\0")
    with WorkDir(tmp_path / "w", {"run": 1}) as resumed:  # another process's file: its digest is checked
        assert resumed.done("forward0")
        with pytest.raises(UserError, match="truncated or changed"):
            resumed.load("x1")
        path.write_bytes(data)
        assert torch.equal(resumed.load("x1")["x"], x)
