"""Binding a service's ports before it says anything: a taken port is one error line.

gRPC servers set SO_REUSEPORT by default, so a second server on a taken port binds
"successfully" and the two share (or steal) its connections; ours turn it off
(`GRPC_SERVER_OPTIONS`). HTTP servers bind their socket here first and hand it over.
"""

from __future__ import annotations

import socket

from pagedweight.common.errors import UserError

# grpc.aio.server(options=...): never share a port with another process
GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class PortInUseError(UserError):
    """A port this service must listen on is taken (or not ours to take)."""


def add_grpc_port(server, host: str, port: int, flag: str = "--port", credentials=None) -> int:
    """server.add_insecure_port (add_secure_port with credentials), with a taken port as
    one clear error."""
    if port != 0:  # a plain bind first: gRPC's own failure also logs a C-core line to stderr
        bind_tcp(host, port, flag).close()
    try:
        if credentials is not None:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as err:  # grpcio >= 1.66 raises where older versions returned 0
        raise PortInUseError(f"{flag} {port}: cannot listen on {host}:{port} (already in use?): {err}") from None
    if bound == 0:
        raise PortInUseError(f"{flag} {port}: cannot listen on {host}:{port} (already in use?)")
    return bound


def bind_tcp(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening-ready socket on host:port (SO_REUSEADDR as uvicorn and http.server set it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise UserError(f"{flag} {port}: cannot resolve {host}: {err}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise PortInUseError(f"{flag} {port}: cannot listen on {host}:{port}: {err.strerror}") from None
    return sock
