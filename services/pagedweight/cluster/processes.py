"""Start the cluster's processes, wait until each is ready, stop them in order.

Each service runs as `python -m pagedweight.cli.main <command>` with its log lines
prefixed by its name on our stdout. Readiness: the planner and the worker answer their
gRPC health check (the worker's readiness service, so the model is loaded); the gateway
answers GET /health with 200. Stopping goes front to back (gateway, workers, planner) with
SIGTERM, so the workers drain their running requests (side by side: stop_together). A service that exits while the
cluster runs is started again (`may_restart` bounds a crash loop); the others keep going
(a worker without its planner serves on its last plan and re-registers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set on top of ours (a worker's CUDA_VISIBLE_DEVICES)
    process: subprocess.Popen | None = None

    restarts: list = field(default_factory=list)  # time.monotonic() of each restart

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "pagedweight.cli.main", *self.argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                        env={**os.environ, **self.env})
        print(f"[serve] started {self.name} (pid {self.process.pid})", flush=True)
        threading.Thread(target=self._pipe, args=(self.process,), daemon=True).start()

    def _pipe(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()

    def may_restart(self, max_restarts: int, window_s: float) -> bool:
        """Whether one more restart stays within max_restarts per window_s (a crash loop does not)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < window_s]
        if len(self.restarts) >= max_restarts:
            return False
        self.restarts.append(now)
        return True

    @property
    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        """SIGTERM: the service drains and exits (stop() waits for it)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def stop_together(services: list[Service], timeout_s: float) -> None:
    """SIGTERM to all, then wait for each: N workers drain side by side, not one after another."""
    for service in services:
        service.terminate()
    for service in services:
        service.stop(timeout_s)


def grpc_serving(address: str, service: str = "") -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


class ServiceExited(RuntimeError):
    """A service exited before it was ready (a taken port, a bad argument, a crash), as opposed
    to one that is still starting when the wait times out."""


def wait_until(ready, service: Service, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if service.exited is not None:
            raise ServiceExited(f"{service.name} exited with code {service.exited} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service.name} not ready after {timeout_s:.0f}s")
        time.sleep(0.2)
