"""Real service processes on loopback for the e2e tests: start, wait ready, read logs, stop."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


# Ports for the services the tests start. `make test` runs test files in several pytest-xdist
# processes at once: a port found free by binding port 0 in one of them can be taken by a server
# another one starts before this one's service binds it, and a readiness probe then reaches the
# wrong server. So each xdist process hands out ports from its own range, below the kernel's
# ephemeral range (32768 and up by default) where port-0 binds and outgoing connections land,
# moving forward through it so one process does not reuse a port a test just released.
# With more processes than the space below it holds at 1,500 ports each, each takes less.
PORTS_BASE, PORTS_END, PORTS_PER_PROCESS = 20000, 32768, 1500
_next_port = itertools.count()


def _port_range() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw<i>"; unset outside xdist
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    processes = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = min(PORTS_PER_PROCESS, (PORTS_END - PORTS_BASE) // processes)
    first = PORTS_BASE + index * size
    return range(first, first + size)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_runs(*counts: int) -> list[int]:
    """The first port of each run of `count` consecutive free ports from this process's range,
    all runs apart (serve gives worker i the first + i)."""
    ports = _port_range()
    firsts = []
    for count in counts:
        for _ in range(len(ports)):
            first = ports[next(_next_port) % (len(ports) - count)]
            if all(_bindable(first + i) for i in range(count)):
                firsts.append(first)
                for _ in range(count - 1):
                    next(_next_port)
                break
        else:
            raise RuntimeError(f"no {count} consecutive free ports in {ports}")
    return firsts


def free_port() -> int:
    return free_port_runs(1)[0]


class Proc:
    """`pagedweight <argv>` in a subprocess, its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path):
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("services", "kernels")),
                   PYTHONUNBUFFERED="1")
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen([sys.executable, "-m", "pagedweight.cli.main", *argv],
                                      stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def signal(self, sig=signal.SIGTERM) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def health_status(address: str, service: str = "") -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0).status
        except grpc.RpcError:
            return None


def wait_for(predicate, proc: Proc, timeout: float = 60, what: str = "ready") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.popen.poll() is not None:
            raise AssertionError(f"process exited ({proc.popen.returncode}) before {what}:\n{proc.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout}s:\n{proc.log()}")
        time.sleep(0.1)


def wait_serving(proc: Proc, address: str, service: str = "", timeout: float = 60) -> None:
    wait_for(lambda: health_status(address, service) == health_pb2.HealthCheckResponse.SERVING, proc, timeout)


def scrape(port: int) -> dict[str, float]:
    """The /metrics page as {series with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for series, value in samples.items():
        base, _, rest = series.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total, found = total + value, True
    if not found:
        raise KeyError(f"no series {name} {labels}")
    return total
