"""A Redis that goes away and comes back, as an operator meets it: the gateway says it is
degraded, refuses session requests with a 503 naming Redis (never answers them without
their history), keeps serving the others, reconnects by itself, and a session Redis lost
comes back marked new. Runs its own redis-server on a free port (never the shared one)."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import openai
import pytest
import redis

from tests.e2e.cluster import free_port, start_gateway, start_worker, stop_all, wait_worker

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def start_redis(port: int, log_dir, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", *extra], stdout=open(log_dir / f"redis-{port}.log", "a"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
        assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
        time.sleep(0.1)
    return proc


def start_cluster(paged_dir, tmp_path, redis_port: int, key_prefix: str, services: list):
    """A worker and a gateway whose sessions live in the Redis on redis_port, each appended to
    `services` as it starts (so a failed start still stops the others); (gateway, its url) once
    the gateway reports its Redis healthy."""
    worker, address = start_worker("worker", paged_dir, tmp_path)
    services.append(worker)
    wait_worker(worker, address)
    gateway, url = start_gateway("gateway", paged_dir, [address], tmp_path, key_prefix,
                                 extra=("--redis-url", f"redis://127.0.0.1:{redis_port}/0"))
    services.insert(0, gateway)
    assert wait_health(url, "ok")["session_store"] == "redis"
    return gateway, url


def wait_health(url: str, status: str, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/health", timeout=5).json()
        if body.get("status") == status or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def chat(url: str, session: str, content: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"x-session-id": session},
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0})


def rejected(url: str, reason: str) -> float:
    """pagedweight:gateway_rejected_total for one reason, from the gateway's /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pagedweight:gateway_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_redis_out_of_memory_is_a_503_in_redis_words_and_counted(paged_micro_dir, tmp_path):
    port = free_port()
    redis_proc = start_redis(port, tmp_path, "--maxmemory-policy", "noeviction")
    services = []
    try:
        gateway, url = start_cluster(paged_micro_dir, tmp_path, port, "oom:", services)
        client = redis.Redis(port=port)
        try:  # Redis full: any write is refused from now on
            client.config_set("maxmemory", 1)
            with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
                client.set("probe", "x")
        finally:
            client.close()
        refused = chat(url, "s1", "Hello")
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "maxmemory" in message and "refused the command" in message
        assert "does not answer" not in gateway.log_path.read_text()
        assert rejected(url, "session_store") == 1.0
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert plain.status_code == 200  # requests without a session are served
    finally:
        stop_all(services)
        redis_proc.terminate()
        redis_proc.wait()


def test_redis_restart_degrades_then_recovers_and_lost_history_is_visible(paged_micro_dir, tmp_path):
    port = free_port()
    redis_proc = start_redis(port, tmp_path)
    services = []
    try:
        gateway, url = start_cluster(paged_micro_dir, tmp_path, port, "outage:", services)

        first = chat(url, "s1", "Hello")
        assert first.status_code == 200 and first.headers["x-session-status"] == "new"
        again = chat(url, "s1", "And then?")
        assert again.status_code == 200 and again.headers["x-session-status"] == "continued"

        redis_proc.kill()
        redis_proc.wait()
        refused = chat(url, "s1", "Still there?")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == 503 and "Redis" in error["message"] and error["param"] == "session_id"
        assert rejected(url, "session_store") == 1.0
        health = wait_health(url, "degraded")
        assert health["status"] == "degraded" and health["session_store"] == "unavailable"
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        plain = api.completions.create(model="micro", prompt="Hi", max_tokens=2)  # no session: served
        assert plain.usage.completion_tokens == 2

        redis_proc = start_redis(port, tmp_path)  # restarted empty: the history is gone
        assert wait_health(url, "ok")["session_store"] == "redis"
        back = chat(url, "s1", "Back?")
        assert back.status_code == 200 and back.headers["x-session-status"] == "new"
        assert "does not answer" in gateway.log_path.read_text() and "answers again" in gateway.log_path.read_text()
    finally:
        stop_all(services)
        if redis_proc.poll() is None:
            redis_proc.terminate()
            redis_proc.wait()
