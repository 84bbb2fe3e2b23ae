"""Sessions in the real Redis at 127.0.0.1:6379, and the in-process fallback."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from pagedweight.gateway.sessions import MemorySessionStore, RedisSessionStore, Session, open_session_store

REDIS_URL = "redis://127.0.0.1:6379/0"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def prefix():
    return f"pw-test-{uuid.uuid4().hex[:8]}:"


def test_two_stores_share_a_session_through_redis(prefix):
    async def go():
        a = await open_session_store(REDIS_URL, prefix, ttl_s=30)
        b = await open_session_store(REDIS_URL, prefix, ttl_s=30)
        assert isinstance(a, RedisSessionStore) and isinstance(b, RedisSessionStore)
        assert await a.get("s1") is None
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        await a.put("s1", Session(worker="w:1", messages=turns))
        got = await b.get("s1")
        ttl = await b._client.pttl(b.key("s1"))
        await a._client.delete(a.key("s1"))
        await a.close(), await b.close()
        return got, ttl

    got, ttl = run(go())
    assert got == Session(worker="w:1", messages=[{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}])
    assert 0 < ttl <= 30_000


def test_session_expires_after_its_ttl(prefix):
    async def go():
        store = await open_session_store(REDIS_URL, prefix, ttl_s=0.2)
        await store.put("s", Session(worker="w:1"))
        present = await store.get("s")
        await asyncio.sleep(0.4)
        gone = await store.get("s")
        await store.close()
        return present, gone

    present, gone = run(go())
    assert present is not None and gone is None


def test_no_redis_falls_back_to_memory_loudly(caplog, prefix):
    async def go():
        store = await open_session_store("redis://127.0.0.1:1/0", prefix, ttl_s=30)
        await store.put("s", Session(worker="w:2"))
        return store, await store.get("s")

    with caplog.at_level(logging.ERROR, logger="pagedweight.gateway.sessions"):
        store, got = run(go())
    assert isinstance(store, MemorySessionStore)
    assert got.worker == "w:2"
    assert "IN THIS PROCESS ONLY" in caplog.text


def test_redis_failing_later_raises_instead_of_dropping_histories(caplog, prefix):
    """A store made while Redis answered, whose Redis then stops answering (port 1): calls
    raise (no empty in-process store in its place), and it says so once."""
    import redis.asyncio as aioredis

    from pagedweight.gateway.sessions import SessionStoreUnavailable

    async def go():
        client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
        store = RedisSessionStore(client, "redis://127.0.0.1:1/0", prefix, ttl_s=30, retry_s=60)
        with pytest.raises(SessionStoreUnavailable, match="Redis at redis://127.0.0.1:1/0"):
            await store.put("s", Session(worker="w:3"))
        with pytest.raises(SessionStoreUnavailable):
            await store.get("s")  # within retry_s: refused without waiting on Redis again
        healthy = await store.check()
        await store.close()
        return store, healthy

    with caplog.at_level(logging.ERROR, logger="pagedweight.gateway.sessions"):
        store, healthy = run(go())
    assert store.backend == "redis" and not store.available and not healthy
    assert caplog.text.count("does not answer") == 1


def test_memory_store_expires():
    async def go():
        store = MemorySessionStore(ttl_s=0.05)
        await store.put("s", Session(worker="x"))
        await asyncio.sleep(0.1)
        return await store.get("s")

    assert run(go()) is None
