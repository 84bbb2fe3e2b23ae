"""`pagedweight gateway` flags: bad values give one `error:` line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import BUNDLED_MODEL, REPO_ROOT


@pytest.mark.parametrize("argv,needle", [
    (["--model", str(BUNDLED_MODEL), "--workers", "nonsense"], "'nonsense' is not host:port"),
    (["--model", str(BUNDLED_MODEL), "--workers", ","], "at least one worker"),
    (["--model", "/no/such/dir", "--workers", "127.0.0.1:1"], "/no/such/dir"),
    (["--model", str(REPO_ROOT / "data"), "--workers", "127.0.0.1:1"], "no tokenizer.json"),
    (["--model", str(BUNDLED_MODEL), "--workers", "127.0.0.1:1", "--max-queued-requests", "0"],
     "--max-queued-requests"),
    (["--model", str(BUNDLED_MODEL), "--workers", "127.0.0.1:1", "--session-ttl", "-1"], "--session-ttl"),
])
def test_bad_flags_give_one_error_line_and_exit_2(argv, needle):
    result = subprocess.run([sys.executable, "-m", "pagedweight.cli.gateway_cmd", *argv], capture_output=True,
                            text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedweight gateway: error:") and needle in lines[0], lines
