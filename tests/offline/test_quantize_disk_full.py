"""A disk that fills up during `pagedweight quantize`: one error line, and nothing that
existed before is lost -- the previous artifact at --out stays whole and usable.

The full disk is a file-size limit (RLIMIT_FSIZE) on the quantize process: each write past
it fails with EFBIG, as a write on a full disk fails with ENOSPC, without filling this
machine's disk."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pagedweight.format.paged_model import load_paged_model
from service_procs import REPO
from tests.conftest import BUNDLED_MODEL
from tests.fuzz.harness import tree_digest


# The limit is set by a fresh interpreter that then execs the command, not by a preexec_fn: a
# preexec_fn runs this process's after-fork hooks in the child (gRPC's among them, where an earlier
# test in the same worker used gRPC), which can abort the child before it execs.
SMALL_FILES = ("import os, resource, signal, sys; "
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # a failed write, not a killed process
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.slow
def test_a_full_disk_during_quantize_loses_no_artifact(paged_micro_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(paged_micro_dir, out)  # the good artifact a re-quantise (--force) would replace
    before = tree_digest(out)
    calib = tmp_path / "calib.txt"
    calib.write_text("In the beginning God created the heaven and the earth. " * 40)
    result = subprocess.run(
        [sys.executable, "-c", SMALL_FILES, "-m", "pagedweight.cli.main", "quantize", "--model", str(BUNDLED_MODEL), "--out", str(out),
         "--force", "--quiet", "--calib", str(calib), "--calib-tokens", "256", "--seq-len", "32",
         "--scale-tokens", "0", "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={"PYTHONPATH": f"{REPO}/services:{REPO}/kernels", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("pagedweight quantize: error:"), lines[-5:]
    assert "too large" in lines[-1].lower() or "no space" in lines[-1].lower(), lines[-1]
    assert tree_digest(out) == before  # the previous artifact, byte for byte
    load_paged_model(out)  # and still loads
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.tmp")]  # no half-written sibling
