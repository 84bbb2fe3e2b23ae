"""A burst of 200 concurrent requests against one worker with a small memory budget.

None may be lost: each completes or is refused with 503 (the gateway's queue limit), and
the worker's memory never goes past its budget (sampled from its stats all along).
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tests.e2e.cluster import start_gateway, start_worker, stop_all, wait_worker, worker_stats

NUM_REQUESTS = 200
BUDGET = "18MiB"  # below the 8-bit experts + the burst's KV, so the budget is the limit
MAX_QUEUED = 120


@pytest.fixture(scope="module")
def small_cluster(paged_micro_dir, tmp_path_factory, redis_prefix):
    logs = tmp_path_factory.mktemp("burst_logs")
    services = []
    try:
        worker, address = start_worker("worker_small", paged_micro_dir, logs, memory_budget=BUDGET)
        services.append(worker)
        wait_worker(worker, address)
        gateway, url = start_gateway("gateway_burst", paged_micro_dir, [address], logs, redis_prefix,
                                     extra=("--max-queued-requests", str(MAX_QUEUED)))
        services.append(gateway)
        yield {"url": url, "worker": address}
    finally:
        stop_all(list(reversed(services)))


class MemorySampler(threading.Thread):
    """Reads the worker's memory split every few milliseconds until stopped."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.samples, self.halt = address, [], threading.Event()

    def run(self):
        while not self.halt.is_set():
            memory = worker_stats(self.address).memory
            used = (sum(memory.expert_bytes_by_bits.values()) + memory.dense_weight_bytes + memory.workspace_bytes
                    + memory.kv_used_bytes + memory.kv_free_bytes + memory.in_transit_bytes)
            self.samples.append((memory.budget_bytes, used, memory.free_bytes))
            self.halt.wait(0.01)


async def burst(url: str):
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int):
        try:
            done = await api.completions.create(model="micro", prompt=f"Request {i}: in the beginning",
                                                max_tokens=8, temperature=0.7, seed=i)
            return done.choices[0].finish_reason
        except openai.APIStatusError as err:
            return err.status_code

    results = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    await api.close()
    return results


def test_burst_loses_nothing_and_keeps_the_budget(small_cluster):
    sampler = MemorySampler(small_cluster["worker"])
    sampler.start()
    try:
        results = asyncio.run(burst(small_cluster["url"]))
    finally:
        sampler.halt.set()
        sampler.join()
    finished = [r for r in results if r in ("stop", "length")]
    refused = [r for r in results if r == 503]
    assert len(finished) + len(refused) == NUM_REQUESTS, sorted(set(map(str, results)))
    assert len(finished) >= MAX_QUEUED // 2
    assert len(sampler.samples) > 10
    for budget, used, free in sampler.samples:
        assert used <= budget and free >= 0, (budget, used, free)
    peak_budget, peak_used, _ = max(sampler.samples, key=lambda s: s[1])
    assert peak_used > 0.9 * peak_budget  # the budget was really the limit, not a formality
    stats = worker_stats(small_cluster["worker"])
    assert stats.load.num_running == 0 and stats.load.num_waiting == 0
    metrics = httpx.get(f"{small_cluster['url']}/metrics", timeout=10).text
    running = [l for l in metrics.splitlines() if l.startswith("vllm:num_requests_running")]
    assert running and float(running[0].rsplit(" ", 1)[1]) == 0.0
