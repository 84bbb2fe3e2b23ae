"""Real service processes on loopback for the end-to-end tests.

Each service is its own process, started as users start it (`pagedweight planner`,
`pagedweight worker`, `python -m pagedweight.cli.gateway_cmd`), with its log in a file that a
failing test prints. Ports come from `service_procs.free_port` (this test process's own range).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from pagedweight.rpc import worker_pb2, worker_pb2_grpc
from service_procs import free_port

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"


def _env() -> dict:
    env = dict(os.environ)
    paths = [str(REPO / "services"), str(REPO / "kernels")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Service:
    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, *argv], stdout=self._log, stderr=subprocess.STDOUT,
                                        env=_env(), cwd=REPO)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def wait_until(check, service: Service, timeout_s: float = 90.0, what: str = "ready") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service.check_alive()
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{service.name} not {what} after {timeout_s} s:\n{service.log_tail()}")


def start_planner(log_dir: Path) -> tuple[Service, str]:
    port = free_port()
    service = Service("planner", ["-m", "pagedweight.cli.main", "planner", "--port", str(port)], log_dir)
    return service, f"127.0.0.1:{port}"


def start_worker(name: str, model_dir: Path, log_dir: Path, memory_budget: str = "64MiB",
                 planner: str | None = None, extra: tuple[str, ...] = ()) -> tuple[Service, str]:
    port = free_port()
    argv = ["-m", "pagedweight.cli.main", "worker", "--model", str(model_dir), "--port", str(port),
            "--memory-budget", memory_budget, *extra]
    if planner:
        argv += ["--planner", planner]
    return Service(name, argv, log_dir), f"127.0.0.1:{port}"


def worker_stats(address: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5)


def wait_worker(service: Service, address: str) -> None:
    wait_until(lambda: worker_stats(address).ready, service)


def launch_gateway(name: str, model_dir: Path, workers: list[str], log_dir: Path, key_prefix: str,
                   extra: tuple[str, ...] = ()) -> tuple[Service, str]:
    """Starts a gateway without waiting (see wait_gateway), so several start together."""
    port = free_port()
    argv = ["-m", "pagedweight.cli.gateway_cmd", "--model", str(model_dir), "--port", str(port),
            "--workers", ",".join(workers), "--redis-url", REDIS_URL, "--session-key-prefix", key_prefix,
            "--served-model-name", "micro", *extra]
    return Service(name, argv, log_dir), f"http://127.0.0.1:{port}"


def wait_gateway(service: Service, url: str, ready: tuple[int, ...] = (200,)) -> None:
    """ready: the /health statuses that count (503 means up, but no worker is ready)."""
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code in ready, service)


def start_gateway(name: str, model_dir: Path, workers: list[str], log_dir: Path, key_prefix: str,
                  extra: tuple[str, ...] = (), wait: bool = True) -> tuple[Service, str]:
    service, url = launch_gateway(name, model_dir, workers, log_dir, key_prefix, extra)
    wait_gateway(service, url, (200,) if wait else (200, 503))
    return service, url


def stop_all(services: list[Service]) -> None:
    """SIGTERM to all at once, then wait for each (front ones first in the list)."""
    for service in services:
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
    for service in services:
        service.stop()
