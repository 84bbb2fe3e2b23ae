"""Per-request plumbing in front of every route (one pure ASGI middleware, so streams pass
through untouched):

- X-Request-Id: taken from the request or made up, put in `request.state.request_id`
  and sent back on every response, errors included;
- the API key: `/v1/*` needs `Authorization: Bearer <key>` when one is set (401 JSON);
  `/health` and `/metrics` stay open, as in vLLM;
- the body limit: a body over `max_body_bytes` gets 413 JSON before any parsing.
"""

from __future__ import annotations

import hmac
import json
import uuid

from pagedweight.gateway.errors import error_body

MAX_REQUEST_ID_CHARS = 256
DRAIN_LIMIT = 256 << 20  # bytes of an oversized body read and dropped before answering


class GatewayMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id", "")[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if self.api_key and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _json(send_with_id, 401, error_body(401, "invalid or missing API key "
                                                                      "(Authorization: Bearer <key>)"))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive)
            if body is None:
                return await _json(send_with_id, 413, error_body(
                    413, f"the request body is larger than {self.max_body_bytes} bytes"))
            receive = _replay(body, receive)
        await self.app(scope, receive, send_with_id)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None when it passes the limit. An oversized body is still
        read (and dropped, up to DRAIN_LIMIT) so the client, still sending, gets the 413
        instead of a broken connection."""
        chunks, size = [], 0
        while size <= DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks) if size <= self.max_body_bytes else None


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as Starlette expects

    return replayed


async def _json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
