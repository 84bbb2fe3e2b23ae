"""A small HTTP server for a gRPC service's side port: /metrics, /health, /ready.

Prometheus scrapes /metrics; Kubernetes probes /health (liveness: the process answers)
and /ready (readiness: 503 while loading or draining). `refresh` runs before each
scrape so gauges read from the engine are current. Runs in its own thread (the standard
library's ThreadingHTTPServer), so a busy event loop never delays a probe.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry

from pagedweight.common.metrics import exposition


class StatusHttpServer:
    def __init__(self, registry: CollectorRegistry, is_live: Callable[[], bool],
                 is_ready: Callable[[], bool], refresh: Callable[[], None] | None = None,
                 details: Callable[[], dict] | None = None):
        self.registry, self.is_live, self.is_ready, self.refresh = registry, is_live, is_ready, refresh
        self.details = details  # a JSON body for /health and /ready (start-up progress); None: plain text
        self._server: ThreadingHTTPServer | None = None
        self.port: int | None = None

    def start(self, host: str, port: int, sock=None) -> None:
        """sock: a socket already bound to host:port (common.ports.bind_tcp), so a taken
        port fails before the service claims anything."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    if owner.refresh is not None:
                        owner.refresh()
                    body, ctype = exposition(owner.registry)
                    self._send(200, body, ctype)
                elif path in ("/health", "/ready"):
                    ok = owner.is_live() if path == "/health" else owner.is_ready()
                    if owner.details is not None:
                        body = json.dumps(owner.details()).encode() + b"\n"
                        self._send(200 if ok else 503, body, "application/json")
                    else:
                        self._send(200 if ok else 503, b"ok\n" if ok else b"unavailable\n", "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes every few seconds: keep the log quiet
                pass

        if sock is None:
            self._server = ThreadingHTTPServer((host, port), Handler)
        else:
            self._server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
            self._server.socket.close()
            self._server.socket = sock
            self._server.server_activate()
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="status-http").start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
