"""Untrusted JSON files and file names from files: one clear error each, never a traceback."""

from __future__ import annotations

import os

import pytest

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.common.json_files import parse_json_object, read_json_object
from pagedweight.common.safe_paths import inside_dir


@pytest.mark.parametrize("data, fragment", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b"42", "expected a JSON object, got int"),
    (b"{" * 5, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
])
def test_bad_json_files_are_one_user_error(tmp_path, data, fragment):
    path = tmp_path / "f.json"
    path.write_bytes(data)
    with pytest.raises(UserError, match=fragment) as err:
        read_json_object(path, "test file")
    assert str(path) in str(err.value) and len(str(err.value)) < 400


def test_json_reader_raises_the_callers_error_class(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_json_object(tmp_path / "missing.json", "config", CheckpointError)
    assert parse_json_object('{"a": [1, 2.5]}', "x") == {"a": [1, 2.5]}


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "a/../../secret", "", "a\\..\\b", "x\0y", 7, None])
def test_names_that_leave_the_directory_are_refused(tmp_path, name):
    base = tmp_path / "model"
    base.mkdir()
    with pytest.raises(CheckpointError):
        inside_dir(base, name)


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    base = tmp_path / "model"
    base.mkdir()
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", base / "shard.safetensors")
    with pytest.raises(CheckpointError, match="outside"):
        inside_dir(base, "shard.safetensors")
    (base / "sub").mkdir()
    assert inside_dir(base, "sub/ok.safetensors") == base / "sub" / "ok.safetensors"
