"""uvicorn's h11 protocol with a deadline on request headers (slowloris).

uvicorn times out idle keep-alive connections but not a client that sends its request
line and headers one byte at a time: each byte cancels the keep-alive timer, and the
connection (and its buffers) is held for as long as the client likes. Here a connection
gets `header_timeout_s` from its start, and from the end of each response, to complete
the next request's headers; past that it is answered 408 and closed. The body has its
own deadline in the middleware (it is read there, by the app).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
TIMEOUT_BODY = (b'{"error": {"message": "the request headers did not arrive in time", '
                b'"type": "RequestTimeoutError", "param": null, "code": 408}}')


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of ours is on the wire: a proper answer
            self.transport.write(TIMEOUT_RESPONSE % (len(TIMEOUT_BODY), TIMEOUT_BODY))
        self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's `http=` with this deadline."""
    return type("GatewayH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
