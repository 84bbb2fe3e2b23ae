"""A port already in use: one error line and exit code 2, before the service claims to serve.

gRPC servers share a port with SO_REUSEPORT by default, so the planner and the worker are
tried on the port of a running planner (another gRPC server), not only on a plain socket.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from contextlib import contextmanager

import pytest

from service_procs import REPO, Proc, free_port, wait_serving


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedweight.cli.main", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, flag: str, port: int) -> None:
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, output
    assert len(output) == 1, output
    assert f"{flag} {port}" in output[0] and "error" in output[0], output


@contextmanager
def listening_port():
    """A loopback port some other socket holds, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.fixture(scope="module")
def running_planner(tmp_path_factory):
    port = free_port()
    proc = Proc(["planner", "--port", str(port)], tmp_path_factory.mktemp("ports") / "planner.log")
    try:
        wait_serving(proc, f"127.0.0.1:{port}")
        yield port
    finally:
        proc.stop()


def test_a_second_planner_on_a_planners_port_is_refused(running_planner):
    assert_one_line_error(run_cli("planner", "--port", str(running_planner)), "--port", running_planner)


def test_a_worker_on_a_planners_port_is_refused_before_loading(running_planner, paged_micro_dir):
    result = run_cli("worker", "--model", str(paged_micro_dir), "--port", str(running_planner))
    assert_one_line_error(result, "--port", running_planner)


def test_a_worker_metrics_port_in_use_is_refused_before_loading(paged_micro_dir):
    with listening_port() as port:
        result = run_cli("worker", "--model", str(paged_micro_dir), "--port", str(free_port()),
                         "--http-port", str(port))
    assert_one_line_error(result, "--http-port", port)


def test_a_gateway_on_a_taken_port_says_nothing_of_serving(paged_micro_dir):
    with listening_port() as port:
        result = run_cli("gateway", "--model", str(paged_micro_dir), "--port", str(port),
                         "--workers", f"127.0.0.1:{free_port()}")
    assert_one_line_error(result, "--port", port)


def test_a_service_on_a_taken_port_is_told_apart_from_a_slow_one():
    """What a start that retries on fresh ports relies on (bench/serve_load.start_cluster): a
    service that exits (here: on a taken port) raises ServiceExited; one still starting when the
    wait times out raises a plain RuntimeError, which a retry would not cure."""
    from pagedweight.cluster.processes import Service, ServiceExited, wait_until

    with listening_port() as port:
        taken = Service("planner", ["planner", "--port", str(port)])
        taken.start()
        try:
            with pytest.raises(ServiceExited, match="exited with code 2"):
                wait_until(lambda: False, taken, timeout_s=120)
        finally:
            taken.stop(10)
    slow = Service("planner", ["planner", "--port", str(free_port())])
    slow.start()
    try:
        with pytest.raises(RuntimeError, match="not ready after") as caught:
            wait_until(lambda: False, slow, timeout_s=0.5)
        assert not isinstance(caught.value, ServiceExited)
    finally:
        slow.stop(10)
