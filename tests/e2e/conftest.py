"""Fixtures of the end-to-end tests: a distinct Redis key prefix per run, log folders."""

from __future__ import annotations

import uuid

import pytest
import redis


@pytest.fixture(scope="session")
def redis_prefix():
    """Keys of this run live under their own prefix and are deleted afterwards."""
    prefix = f"pw-e2e-{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()
