"""Shared, read-only fixtures of the fuzz suite: real models and text on disk."""

from __future__ import annotations

import pytest

from tests.conftest import BUNDLED_MODEL


@pytest.fixture(scope="session")
def fuzz_text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_text")
    (folder / "valid.txt").write_text("In the beginning God created the heaven and the earth. " * 4)
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    (folder / "empty.txt").write_text("")
    return folder


@pytest.fixture(scope="session")
def checkpoint_dir():
    return BUNDLED_MODEL
