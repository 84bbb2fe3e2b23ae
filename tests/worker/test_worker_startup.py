"""A worker's start is never silence: its log names each phase with percent and ETA, its
side port answers /health from the first moment with the phase, and a gateway in front of
it says how far its workers are while none is ready."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from pagedweight.runtime import STARTUP_PHASES
from service_procs import Proc, free_port, wait_for

pytestmark = pytest.mark.slow


def health(port: int) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return None


def test_startup_progress_in_the_log_and_in_health(paged_micro_dir, tmp_path):
    http_port, grpc_port, gateway_port = free_port(), free_port(), free_port()
    # the gateway first (its text sandbox takes a moment to start): it must be answering
    # while the worker loads
    gateway = Proc(["gateway", "--model", str(paged_micro_dir), "--port", str(gateway_port),
                    "--workers", f"127.0.0.1:{grpc_port}", "--stats-interval", "0.1"], tmp_path / "gateway.log")
    worker = None
    try:
        wait_for(lambda: health(gateway_port) is not None, gateway, timeout=60, what="the gateway answers")
        worker = Proc(["worker", "--model", str(paged_micro_dir), "--port", str(grpc_port), "--http-port",
                       str(http_port), "--memory-budget", "32MiB"], tmp_path / "worker.log")
        seen, gateway_said = [], []
        deadline = time.monotonic() + 120
        while not seen or seen[-1]["status"] != "ready":
            assert time.monotonic() < deadline, worker.log()
            answer = health(http_port)
            if answer is not None:
                assert answer[0] == 200  # live from the first moment
                seen.append(answer[1])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{gateway_port}/health", timeout=2):
                    pass
            except urllib.error.HTTPError as err:
                gateway_said.append(json.loads(err.read())["error"]["message"])
            except OSError:
                pass
            time.sleep(0.05)
        starting = [s for s in seen if s["status"] == "starting"]
        assert starting, seen
        assert all(s["phase"] in STARTUP_PHASES and 0 <= s["percent"] < 100 for s in starting)
        assert [s["percent"] for s in starting] == sorted(s["percent"] for s in starting)
        assert seen[-1]["percent"] == 100 and seen[-1]["phase"] == "ready"
        assert any("starting:" in m and "%" in m for m in gateway_said), gateway_said
        log = worker.log()
        for phase in ("reading the paged model", "loading the expert pages", "warming up"):
            assert f"worker starting: {phase} (" in log, log
        assert "% after" in log
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()
