"""The worker runs on machines without the gateway's dependencies (fastapi, uvicorn, redis)."""

import subprocess
import sys


def test_worker_and_its_cli_import_without_gateway_dependencies():
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'redis', 'starlette'): sys.modules[name] = None\n"
            "import pagedweight.worker.server, pagedweight.worker.remote_planner\n"
            "from pagedweight.cli.main import build_parser\n"
            "args = build_parser().parse_args(['worker', '--model', '.', '--port', '1'])\n"
            "from pagedweight.cli.worker_cmd import config_from_args\n"
            "assert config_from_args(args).port == 1\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_bad_worker_flags_are_one_error_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedweight.cli.main", "worker", "--model", str(tmp_path / "none")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("pagedweight worker: error: --model")
    assert "Traceback" not in result.stderr
