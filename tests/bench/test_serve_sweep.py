"""bench/serve_load.py --mode sweep end to end on the CPU with tiny settings: the three
layers side by side, each point's numbers and the gateway's CPU in one JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from service_procs import REPO

pytestmark = pytest.mark.slow


def test_the_sweep_runs_three_layers_and_writes_their_table(paged_micro_dir, tmp_path):
    out = tmp_path / "sweep.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("services", "kernels", ".")))
    result = subprocess.run(
        [sys.executable, "-m", "bench.serve_load", "--mode", "sweep", "--model", str(paged_micro_dir),
         "--memory-budget", "64MiB", "--concurrency", "1,3", "--duration", "1", "--prompt-len", "4:12",
         "--output-len", "3:6", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["commit"] and record["date"] and "machine" in record and record["device"] == "cpu"
    assert [row["concurrency"] for row in record["table"]] == [1, 3]
    for row in record["table"]:
        for layer in ("in_process", "worker_grpc", "gateway_http"):
            assert row[layer]["output_tok_s"] > 0 and row[layer]["ttft_p50_ms"] > 0
        assert row["in_process"]["ratio_to_in_process"] == 1.0
        assert row["gateway_cpu_percent"] > 0
    for layer in ("in_process", "worker_grpc", "gateway_http"):
        point = record[layer]["3"]
        assert point["finish_reasons"] == ["length"] and point["completed"] >= 3
    assert "| gateway over HTTP |" in result.stdout
