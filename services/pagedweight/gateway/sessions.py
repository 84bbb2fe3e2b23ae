"""Sessions: a client's worker affinity and, for chat, its conversation so far.

A session is one JSON value under `<prefix>session:<id>` in Redis with a TTL that every
request renews, so any gateway replica (or a restarted one) continues it. With API keys
the tenant is part of the key (`<prefix>tenant:<tenant>:session:<id>`): a session is
bound to the key's tenant that created it, and another tenant sending the same id gets a
session of its own, never this one. A value that is not a session (not JSON, wrong
shape: written by something else, or corrupted) is logged and treated as no session. When Redis does
not answer at start, sessions live in this process instead; that loses them on restart and
splits them across replicas, so it is said loudly in the log and in `pagedweight:session_store`.

When Redis goes away later, the store does not swap in an empty in-process one (that
would drop every history silently): reads and writes raise `SessionStoreUnavailable`
(the request gets a 503 naming Redis), `/health` reports the gateway degraded, and every
call after `retry_s` tries Redis again (redis-py reconnects), so the store comes back by
itself once Redis does. A Redis that restarted empty has lost the histories: a session
the store does not know comes back as new (`X-Session-Status: new`), never as continued.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

log = logging.getLogger("pagedweight.gateway.sessions")

FALLBACK_BANNER = (
    "\n" + "!" * 78 + "\n"
    "!! Redis at {url} does not answer ({err}).\n"
    "!! Sessions are kept IN THIS PROCESS ONLY: a restart loses them and other gateway\n"
    "!! replicas cannot see them. Start Redis or pass --redis-url to share sessions.\n"
    + "!" * 78
)


@dataclass
class Session:
    worker: str | None = None  # the worker address that served it last
    messages: list[dict] = field(default_factory=list)  # chat turns so far: {"role", "content"}
    key: str | None = field(default=None, compare=False)  # where the store keeps it (session_key); not stored
    is_new: bool = False  # not found in the store: this request starts it (not stored)

    def to_json(self) -> str:
        return json.dumps({"worker": self.worker, "messages": self.messages})

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Session | None":
        """The session, or None when `raw` is not one (logged)."""
        try:
            data = json.loads(raw)
            worker, messages = data.get("worker"), data.get("messages") or []
            if not (worker is None or isinstance(worker, str)) or not isinstance(messages, list):
                raise ValueError("unexpected field types")
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages):
                raise ValueError("a message is not {role, content} text")
        except (ValueError, TypeError, AttributeError, RecursionError) as err:
            log.warning("a stored session value is not a session (%s); starting the session afresh", err)
            return None
        return cls(worker=worker, messages=[{"role": m["role"], "content": m["content"]} for m in messages])


class SessionStoreUnavailable(Exception):
    """The session store (Redis) does not answer: the history can be neither read nor saved."""


class MemorySessionStore:
    backend = "memory"
    available = True  # in process: never away

    async def check(self) -> bool:
        return True

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, str]] = {}  # session id -> (expiry time, JSON)

    async def get(self, session_id: str) -> Session | None:
        item = self._items.get(session_id)
        if item is None or item[0] < time.monotonic():
            self._items.pop(session_id, None)
            return None
        return Session.from_json(item[1])

    async def put(self, session_id: str, session: Session) -> None:
        if len(self._items) > 10_000:  # drop the expired before growing further
            now = time.monotonic()
            self._items = {k: v for k, v in self._items.items() if v[0] >= now}
        self._items[session_id] = (time.monotonic() + self.ttl_s, session.to_json())

    async def close(self) -> None:
        pass


class RedisSessionStore:
    """Sessions in Redis; while Redis is away, calls raise SessionStoreUnavailable."""

    backend = "redis"

    def __init__(self, client: aioredis.Redis, url: str, prefix: str, ttl_s: float, retry_s: float = 1.0):
        self._client, self._url = client, url
        self._prefix, self.ttl_s = prefix, ttl_s
        self.retry_s = retry_s  # while away: how often a call (or a health check) tries Redis
        self.down_since: float | None = None  # time.monotonic() of the first failure of an outage
        self._last_try = 0.0
        self._error = ""

    @property
    def available(self) -> bool:
        return self.down_since is None

    def key(self, session_id: str) -> str:
        return f"{self._prefix}{session_id}"

    async def get(self, session_id: str) -> Session | None:
        raw = await self._call(self._client.get(self.key(session_id)))
        return Session.from_json(raw) if raw is not None else None

    async def put(self, session_id: str, session: Session) -> None:
        await self._call(self._client.set(self.key(session_id), session.to_json(), px=int(self.ttl_s * 1000)))

    async def check(self) -> bool:
        """For /health: whether Redis answers (pings at most every retry_s while away)."""
        if self.down_since is not None and time.monotonic() - self._last_try >= self.retry_s:
            try:
                await self._call(self._client.ping())
            except SessionStoreUnavailable:
                pass
        return self.available

    async def _call(self, command):
        if self.down_since is not None and time.monotonic() - self._last_try < self.retry_s:
            command.close()  # not awaited: Redis was away a moment ago
            raise SessionStoreUnavailable(self._describe())
        self._last_try = time.monotonic()
        try:
            result = await command
        except ResponseError as err:
            # Redis answered, with an error (out of memory, a read-only replica): it is up, and
            # the operator needs its own words, not "does not answer"
            log.error("Redis at %s refused a session command: %s", self._url, err)
            raise SessionStoreUnavailable(f"the session store (Redis at {self._url}) refused the command: "
                                          f"{err}") from None
        except (RedisError, OSError) as err:
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.error("Redis at %s does not answer (%s): session requests get 503 and /health says "
                          "degraded until it does; retrying every %.0f s", self._url, err, self.retry_s)
            self._error = str(err)
            raise SessionStoreUnavailable(self._describe()) from None
        if self.down_since is not None:
            log.warning("Redis at %s answers again after %.1f s; sessions are back", self._url,
                        time.monotonic() - self.down_since)
            self.down_since = None
        return result

    def _describe(self) -> str:
        return f"the session store (Redis at {self._url}) is unavailable: {self._error}"

    async def close(self) -> None:
        await self._client.aclose()


async def open_session_store(url: str, prefix: str, ttl_s: float):
    """Redis when it answers a PING within a second, else the in-process store."""
    client = None
    try:
        client = aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        await client.ping()
    except (RedisError, OSError, ValueError) as err:
        if client is not None:
            await client.aclose()
        log.error(FALLBACK_BANNER.format(url=url, err=err))
        return MemorySessionStore(ttl_s)
    log.info("sessions in Redis at %s (keys %ssession:*, ttl %.0f s)", url, prefix, ttl_s)
    return RedisSessionStore(client, url, prefix, ttl_s)


def session_key(session_id: str, tenant: str) -> str:
    """The store's key of a tenant's session (below the store's prefix): tenants' keys
    and the anonymous ones never collide, whatever the ids."""
    return f"tenant:{tenant}:session:{session_id}" if tenant else f"session:{session_id}"
