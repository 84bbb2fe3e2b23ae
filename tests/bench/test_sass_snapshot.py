"""bench/sass_snapshot's command line: the instances it fingerprints, and bad input refused with one
line before anything compiles (the fingerprints themselves need nvcc and nvdisasm, minutes)."""

import pytest

pytest.importorskip("torch")

from bench import sass_snapshot  # noqa: E402
from pagedweight_kernels import apl_moe as op  # noqa: E402


def test_it_fingerprints_every_bf16_gemv_and_staged_instance():
    names = sass_snapshot.instances()
    assert set(op.staged_instances("true")) <= set(names)
    assert all(name in names for name in op.staged_instances("false")[:6])
    assert len(names) == len(set(names)) and sum(n.startswith("apl_gemv") for n in names) > 6


def test_an_unreadable_snapshot_to_compare_is_one_error_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert sass_snapshot.main(["--out", str(tmp_path / "a.json"), "--compare", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sass_snapshot: cannot read")
    assert not (tmp_path / "a.json").exists()
