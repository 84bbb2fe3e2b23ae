"""Tenancy at the gateway, through the official client: API keys kept as digests, sessions
bound to the key's tenant, a rate limit per tenant; and the gateway's calls to a worker
that requires an RPC token."""

from __future__ import annotations

import hashlib
import time
import uuid

import httpx
import openai
import pytest
import redis

from tests.e2e.cluster import REDIS_URL, start_gateway, start_worker, stop_all, wait_until

MODEL = "micro"
KEY_A, KEY_B = "sk-tenant-a-" + "1" * 20, "sk-tenant-b-" + "2" * 20
RPC_TOKEN = "rpc-" + "z" * 30


@pytest.fixture(scope="module")
def tenancy(paged_micro_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenancy_logs")
    keys = logs / "api-keys"
    keys.write_text("".join(f"{t}:{hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in (("a", KEY_A), ("b", KEY_B))))
    tokens = logs / "rpc-token"
    tokens.write_text(f"gateway:{RPC_TOKEN}\n")
    prefix = f"pw-tenancy-{uuid.uuid4().hex[:8]}:"
    services = []
    try:
        worker, address = start_worker("worker", paged_micro_dir, logs, extra=("--rpc-token-file", str(tokens)))
        services.append(worker)
        gateway, url = start_gateway("gateway", paged_micro_dir, [address], logs, prefix, wait=False,
                                     extra=("--api-keys-file", str(keys), "--rpc-token-file", str(tokens),
                                            "--rate-limit", "0.1", "--rate-limit-burst", "6"))
        services.insert(0, gateway)
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, gateway)
        yield {"url": url, "prefix": prefix, "keys": keys}
    finally:
        stop_all(services)
        client = redis.Redis.from_url(REDIS_URL)
        stale = list(client.scan_iter(f"{prefix}*"))
        if stale:
            client.delete(*stale)
        client.close()


def api(url, key):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_keys_are_required_and_kept_as_digests(tenancy):
    with pytest.raises(openai.AuthenticationError):
        api(tenancy["url"], "sk-wrong-" + "0" * 20).models.list()
    response = httpx.post(f"{tenancy['url']}/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert KEY_A not in tenancy["keys"].read_text()
    # the gateway reached the token-protected worker: a key gets an answer
    done = api(tenancy["url"], KEY_A).completions.create(model=MODEL, prompt="In the", max_tokens=2)
    assert done.choices[0].finish_reason in ("stop", "length")


def test_a_session_is_bound_to_the_tenant_that_created_it(tenancy):
    session = f"s-{uuid.uuid4().hex[:6]}"
    headers = {"X-Session-ID": session}
    a, b = api(tenancy["url"], KEY_A), api(tenancy["url"], KEY_B)
    a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "secret of a"}], max_tokens=2,
                              extra_headers=headers)
    b.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "from b"}], max_tokens=2,
                              extra_headers=headers)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        stored_a = client.get(f"{tenancy['prefix']}tenant:a:session:{session}")
        stored_b = client.get(f"{tenancy['prefix']}tenant:b:session:{session}")
    finally:
        client.close()
    assert b"secret of a" in stored_a and b"from b" not in stored_a
    assert b"from b" in stored_b and b"secret of a" not in stored_b  # b never saw, nor extended, a's


def test_requests_past_a_tenants_rate_are_429_and_others_are_not_held_up(tenancy):
    # a bucket of 6 refilled at 0.1/s: slow enough that a loaded machine cannot refill it
    # between these requests; the tests above took 2 of tenant a's tokens
    started = time.monotonic()
    statuses = [httpx.get(f"{tenancy['url']}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"},
                          timeout=10).status_code for _ in range(10)]
    refilled = int((time.monotonic() - started) * 0.1) + 1
    assert set(statuses) == {200, 429} and statuses.count(200) <= 6 + refilled, statuses
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    refused = httpx.get(f"{tenancy['url']}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == 429
    other = httpx.get(f"{tenancy['url']}/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=10)
    assert other.status_code == 200
    assert httpx.get(f"{tenancy['url']}/health", timeout=10).status_code == 200  # not rate-limited
