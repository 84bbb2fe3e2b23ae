"""The wheel is what `pip install .` (the Dockerfile's path) puts in site-packages: it must carry
the CUDA source the kernel compiles at run time, and only import roots named for the project
(a top-level `kernels` collides with Hugging Face's `kernels` package, which transformers probes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    # setuptools builds in the source tree (build/, *.egg-info): build a copy, so the test
    # leaves the checkout as it found it
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("services", "kernels"):
        shutil.copytree(REPO_ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
         "--no-build-isolation", "--quiet", "--wheel-dir", str(out)],
        check=True, cwd=out,
    )
    (wheel,) = out.glob("pagedweight-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_ships_the_cuda_source(wheel_names):
    for source in ("apl_moe.cu", "apl_gemv.cu", "decode_ops.cu", "dtype_conversions.cu"):
        assert f"pagedweight_kernels/{source}" in wheel_names  # each read at run time by a launcher
    assert (REPO_ROOT / "kernels" / "pagedweight_kernels" / "apl_moe.cu").is_file()


def test_wheel_has_only_project_import_roots(wheel_names):
    roots = {name.split("/")[0] for name in wheel_names}
    packages = {r for r in roots if not r.endswith((".dist-info", ".data"))}
    assert packages == {"pagedweight", "pagedweight_kernels"}, packages
    assert "services" not in roots and "kernels" not in roots


def test_wheel_has_every_source_module(wheel_names):
    # a sub-package without __init__.py would be dropped by packages.find
    for root, top in (("services", "pagedweight"), ("kernels", "pagedweight_kernels")):
        for src in (REPO_ROOT / root / top).rglob("*.py"):
            assert src.relative_to(REPO_ROOT / root).as_posix() in wheel_names, src


def test_wheel_ships_the_calibration_text(wheel_names):
    # `pagedweight quantize` without --calib reads it from the installed package
    names = {n for n in wheel_names if "/offline/calib_text/" in n}
    for f in ("prose.calib.txt", "code.calib.txt", "docs.calib.txt", "technical.calib.txt", "README.md",
              "PYTHON-LICENSE.txt"):
        assert f"pagedweight/offline/calib_text/{f}" in names, f
