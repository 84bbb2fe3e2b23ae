"""Faults under a running cluster: a Redis restart and a planner restart. No request is
answered with a 5xx traceback, no session kept in Redis is lost, and the worker goes back
to the restarted planner when it next needs a plan. (A worker killed mid-stream:
test_openai_api.py.)

Redis here is a redis-server of this test's own, on a free port with an append-only file,
never the shared one on 6379."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import httpx
import pytest

from service_procs import free_port
from tests.e2e.cluster import Service, start_gateway, start_planner, start_worker, stop_all, wait_until, wait_worker

MODEL = "micro"
CHAT = {"model": MODEL, "max_tokens": 2}

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class OwnRedis:
    def __init__(self, folder):
        self.folder, self.port = folder, free_port()
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def faults(paged_micro_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fault_logs")
    redis = OwnRedis(tmp_path_factory.mktemp("redis"))
    redis.start()
    services = []
    try:
        planner, planner_address = start_planner(logs)
        worker, address = start_worker("worker", paged_micro_dir, logs, planner=planner_address)
        services += [planner, worker]
        wait_worker(worker, address)
        gateway, url = start_gateway("gateway", paged_micro_dir, [address], logs, f"pw-fault-{uuid.uuid4().hex[:6]}:",
                                     extra=("--redis-url", redis.url))
        services.insert(0, gateway)
        yield {"url": url, "redis": redis, "planner": planner, "planner_address": planner_address, "logs": logs,
               "worker": worker, "gateway": gateway}
    finally:
        stop_all(services)
        redis.stop()


def chat(url, session, text):
    return httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": text}]},
                      headers={"X-Session-ID": session}, timeout=60)


def test_a_redis_restart_loses_no_session_and_requests_without_one_are_served(faults):
    url, redis = faults["url"], faults["redis"]
    session = f"s-{uuid.uuid4().hex[:6]}"
    assert chat(url, session, "first turn").status_code == 200
    redis.stop()
    # a session's history can be neither read nor saved: a 503 naming Redis, never an
    # answer that silently drops the history; a request without a session is served
    during = chat(url, f"other-{session}", "while redis is down")
    assert during.status_code == 503 and "Redis" in during.json()["error"]["message"], during.text
    plain = httpx.post(f"{url}/v1/chat/completions",
                       json={**CHAT, "messages": [{"role": "user", "content": "no session"}]}, timeout=60)
    assert plain.status_code == 200, plain.text
    redis.start()
    deadline = time.monotonic() + 15  # the gateway tries Redis again within a second
    while httpx.get(f"{url}/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the gateway did not see Redis come back"
        time.sleep(0.2)
    after = chat(url, session, "second turn")
    assert after.status_code == 200, after.text
    assert after.headers["x-session-status"] == "continued"
    stored = subprocess.run(["redis-cli", "-p", str(redis.port), "--scan", "--pattern", f"*session:{session}"],
                            capture_output=True, text=True).stdout.split()
    assert stored, "the session written before the restart is gone from Redis"
    assert "Traceback" not in faults["gateway"].log_path.read_text()


def test_a_planner_restart_is_survived_and_the_worker_registers_again(faults):
    url = faults["url"]
    body = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 4}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    faults["planner"].kill()
    for _ in range(3):  # the in-process planner answers meanwhile
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    port = faults["planner_address"].rsplit(":", 1)[1]
    planner = Service("planner_restarted", ["-m", "pagedweight.cli.main", "planner", "--port", port],
                      faults["logs"])
    try:
        wait_until(lambda: "listening" in planner.log_path.read_text(), planner, timeout_s=60)
        for _ in range(3):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        worker_log = faults["worker"].log_path.read_text()
        if "using the in-process planner, reconnecting" in worker_log:  # it needed a plan meanwhile
            wait_until(lambda: "registered" in planner.log_path.read_text(), planner, timeout_s=60,
                       what="re-registered by the worker")
        assert "Traceback" not in worker_log
        faults["worker"].check_alive()
    finally:
        planner.stop()


def test_an_idle_worker_registers_with_a_restarted_planner(paged_micro_dir, tmp_path):
    """A worker whose weights all fit asks for no plan: it must still notice that the
    planner it registered with is gone, and register with the one that replaces it."""
    planner, planner_address = start_planner(tmp_path)
    worker, address = start_worker("worker_idle", paged_micro_dir, tmp_path, memory_budget="1GiB",
                                   planner=planner_address)
    port = planner_address.rsplit(":", 1)[1]
    restarted = None
    try:
        wait_worker(worker, address)
        wait_until(lambda: "registered" in planner.log_path.read_text(), planner, timeout_s=30)
        planner.kill()
        time.sleep(1.0)
        restarted = Service("planner_again", ["-m", "pagedweight.cli.main", "planner", "--port", port], tmp_path)
        wait_until(lambda: "registered" in restarted.log_path.read_text(), restarted, timeout_s=30,
                   what="registered with by the idle worker")
        assert "Traceback" not in worker.log_path.read_text()
    finally:
        stop_all([s for s in (restarted, worker, planner) if s is not None])
