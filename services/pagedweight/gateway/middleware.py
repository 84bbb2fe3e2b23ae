"""Per-request plumbing in front of every route (one pure ASGI middleware, so streams pass
through untouched):

- headers: more than `max_header_bytes` in all gets 431 JSON; an `X-Request-Id` or
  `X-Session-ID` that is not 1..256 visible ASCII characters gets 400 (request ids travel
  as gRPC metadata, where anything else is invalid and would fail the call);
- X-Request-Id: taken from the request or made up, put in `request.state.request_id`
  and sent back on every response, errors included;
- the API keys: `/v1/*` needs `Authorization: Bearer <key>` when keys are set (401 JSON);
  the key's tenant goes in `request.state.tenant` and its rate limit is applied (429);
  `/health` and `/metrics` stay open, as in vLLM;
- the body: over `max_body_bytes` gets 413 JSON before any parsing; a body that does not
  arrive within `body_timeout_s` gets 408;
- disconnect: when the client goes away the request's task is cancelled, for every
  request type (a non-streaming completion stops decoding as a stream does).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid

from pagedweight.gateway.errors import error_body
from pagedweight.gateway.tenants import ANONYMOUS, Tenants

MAX_ID_CHARS = 256
# visible ASCII: valid gRPC metadata, a valid Redis key part, nothing a log line can hide
VALID_ID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_ID_CHARS)
DRAIN_LIMIT = 256 << 20  # bytes of an oversized body read and dropped before answering


def valid_id(value: str) -> bool:
    return VALID_ID.fullmatch(value) is not None


class GatewayMiddleware:
    def __init__(self, app, tenants: Tenants, max_body_bytes: int, max_header_bytes: int = 32 << 10,
                 body_timeout_s: float = 30.0):
        self.app = app
        self.tenants = tenants
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw_headers = scope["headers"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        given_id = headers.get("x-request-id")
        request_id = given_id if given_id and valid_id(given_id) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        scope["state"]["tenant"] = ANONYMOUS

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("ascii"))]
            await send(message)

        size = sum(len(k) + len(v) for k, v in raw_headers)
        if size > self.max_header_bytes:
            return await _json(send_with_id, 431, error_body(
                431, f"the request headers are larger than {self.max_header_bytes} bytes"))
        for name in ("x-request-id", "x-session-id"):
            value = headers.get(name)
            if value is not None and not valid_id(value):
                return await _json(send_with_id, 400, error_body(
                    400, f"{name}: must be 1 to {MAX_ID_CHARS} visible ASCII characters", name))

        if scope["path"].startswith("/v1"):
            verdict = self.tenants.admit(headers.get("authorization", ""))
            if verdict.status:
                extra = [(b"retry-after", str(verdict.retry_after_s).encode())] if verdict.retry_after_s else []
                return await _json(send_with_id, verdict.status, error_body(verdict.status, verdict.message), extra)
            scope["state"]["tenant"] = verdict.tenant
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                return await _json(send_with_id, 408, error_body(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s"))
            if body is None:
                return await _json(send_with_id, 413, error_body(
                    413, f"the request body is larger than {self.max_body_bytes} bytes"))
            if body is _DISCONNECTED:
                return None
            await self._run_until_disconnect(scope, body, receive, send_with_id)
            return None
        await self.app(scope, receive, send_with_id)

    async def _run_until_disconnect(self, scope, body: bytes, receive, send) -> None:
        """The app with its body replayed, cancelled when the client disconnects."""
        gone = asyncio.Event()

        async def replayed():
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            await gone.wait()
            return {"type": "http.disconnect"}

        app_task = asyncio.ensure_future(self.app(scope, replayed, send))

        async def watch():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    app_task.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await app_task
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # the server itself is cancelling us
        finally:
            watcher.cancel()

    async def _read_body(self, receive):
        """The whole body, None when it passes the limit, _DISCONNECTED when the client
        left. An oversized body is still read (and dropped, up to DRAIN_LIMIT) so the
        client, still sending, gets the 413 instead of a broken connection."""
        chunks, size = [], 0
        while size <= DRAIN_LIMIT:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _DISCONNECTED
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks) if size <= self.max_body_bytes else None


_DISCONNECTED = object()


async def _json(send, status: int, body: dict, extra_headers=()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": payload})
