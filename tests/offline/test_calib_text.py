"""The calibration text bundled with the package: present, mixed, used without --calib, recorded."""

import hashlib
import json

import pytest

from pagedweight.format.paged_model import META_FILE
from pagedweight.offline.calib_text import BUNDLED_NAME, bundled_calib_files
from tests.conftest import BUNDLED_MODEL
from tests.offline.test_quantize_cli import pagedweight  # noqa: F401 - the fixture


def test_bundled_text_is_four_small_domains_with_a_readme():
    files = bundled_calib_files()
    assert [f.name.split(".")[0] for f in files] == ["code", "docs", "prose", "technical"]
    sizes = [f.stat().st_size for f in files]
    assert all(20_000 < s < 100_000 for s in sizes) and sum(sizes) < 400_000, sizes
    readme = (files[0].parent / "README.md").read_text()
    for f in files:  # every file's source and license is written down beside it
        assert f"`{f.name}`" in readme
    assert (files[0].parent / "PYTHON-LICENSE.txt").is_file()


@pytest.mark.slow
def test_quantize_without_calib_uses_and_records_the_bundled_text(tmp_path, pagedweight):  # noqa: F811
    out = tmp_path / "out"
    result = pagedweight("quantize", "--model", str(BUNDLED_MODEL), "--out", str(out), "--quiet",
                         "--calib-tokens", "64", "--seq-len", "64", "--threads", "1")
    assert result.returncode == 0, result.stderr
    calibration = json.loads((out / META_FILE).read_text())["calibration"]
    files = bundled_calib_files()
    assert calibration["num_tokens"] == len(files) * 64
    assert calibration["text"]["name"] == BUNDLED_NAME
    assert calibration["text"]["files"] == [
        {"name": f.name, "num_bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in files]

