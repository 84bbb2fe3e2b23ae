"""PagedLayers (the streamed loss-scale phase's reader) checks the directory it reads:
the same file checks as load_paged_model, before any tensor is read."""

from __future__ import annotations

import shutil

import pytest

from pagedweight.common.errors import CheckpointError
from pagedweight.format.paged_model import APL_FILE, DENSE_FILE
from pagedweight.offline.paged_layers import PagedLayers


def test_a_changed_truncated_or_missing_file_is_refused(paged_micro_dir, tmp_path):
    assert PagedLayers(paged_micro_dir, "cpu").config.num_layers >= 1  # the intact directory reads
    for name, change, message in ((APL_FILE, "flip", "corrupt: sha256"), (DENSE_FILE, "truncate", "truncated"),
                                  (APL_FILE, "remove", "missing")):
        copy = tmp_path / f"{change}"
        shutil.copytree(paged_micro_dir, copy)
        file = copy / name
        data = bytearray(file.read_bytes())
        if change == "flip":
            data[-1] ^= 0xFF
            file.write_bytes(bytes(data))
        elif change == "truncate":
            file.write_bytes(bytes(data[:-1]))
        else:
            file.unlink()
        with pytest.raises(CheckpointError, match=message):
            PagedLayers(copy, "cpu")
