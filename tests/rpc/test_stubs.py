"""The committed gRPC stubs are exactly what `make proto` generates from proto/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check(cwd_root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(cwd_root / "proto" / "generate.py"), "--check"],
                          capture_output=True, text=True)


def test_committed_stubs_are_fresh():
    result = _check(ROOT)
    assert result.returncode == 0, result.stderr


def test_check_fails_when_a_proto_changes(tmp_path):
    """--check must notice a proto edit that was not regenerated (the test can fail)."""
    import shutil

    for sub in ("proto", "services/pagedweight/rpc"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    proto = tmp_path / "proto" / "pagedweight" / "v1" / "worker.proto"
    proto.write_text(proto.read_text().replace("message AbortResponse {",
                                               "message AbortResponse {\n  int32 added_field = 99;"))
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "worker_pb2.py" in result.stderr
