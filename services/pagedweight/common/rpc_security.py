"""Authentication and TLS of the internal gRPC links (gateway -> worker, worker -> planner).

Two layers, each optional, and a refusal when neither protects a reachable port:

- a token: callers send `authorization: Bearer <token>` metadata; the server refuses any
  other call with UNAUTHENTICATED (the standard health service stays open: kubelet's gRPC
  probe sends no metadata, and health reveals nothing). A token file holds one token a
  line, `name:token` or a bare token (named "default"); the server accepts every line and
  knows each call's caller by the name, the client sends the first line. Per-caller
  names are what let a worker refuse to abort a request another caller owns;
- TLS: the server presents `cert`/`key`; with `ca` it also requires client certificates
  signed by that CA (mutual TLS). Clients verify the server against `ca`.

Listening on anything but loopback with no token is refused (`UserError`), unless the
operator says `--insecure-rpc`: a port that anyone on the network can drive must be an
explicit choice, never a default.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagedweight.common.errors import UserError
from pagedweight.common.ports import add_grpc_port

TOKEN_ENV = "PAGEDWEIGHT_RPC_TOKEN"  # a token given by value (Compose, `serve`), not a file
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes callable without a token


# A peer that is down (a worker still starting, a planner restarting) is retried at least every
# 0.5 s: gRPC's default backoff grows to 120 s, so a gateway started a minute before its workers
# would miss their start-up progress and notice them long after they are ready; a small model's
# worker starts in about a second, which a 2 s backoff could miss entirely. A connection attempt to
# a closed port on the cluster network costs next to nothing.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 500)]


@dataclass(frozen=True)
class RpcSecurity:
    tokens: dict[str, str] = field(default_factory=dict)  # token -> caller name
    client_token: str | None = None  # what this process sends
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    insecure: bool = False  # the operator accepted an unauthenticated non-loopback port

    @classmethod
    def from_settings(cls, token_file: str | None = None, ca: str | None = None, cert: str | None = None,
                      key: str | None = None, insecure: bool = False) -> "RpcSecurity":
        tokens: dict[str, str] = {}
        client = None
        if token_file:
            lines = [line.strip() for line in _read(token_file, "--rpc-token-file").decode("utf-8", "replace")
                     .splitlines() if line.strip() and not line.startswith("#")]
            for line in lines:
                name, sep, token = line.partition(":")
                if not sep:
                    name, token = "default", line
                _check_token(token, name, token_file)
                tokens[token] = name
                client = client or token
        elif os.environ.get(TOKEN_ENV):
            client = os.environ[TOKEN_ENV].strip()
            _check_token(client, "default", f"${TOKEN_ENV}")
            tokens[client] = "default"
        if token_file and not tokens:
            raise UserError(f"--rpc-token-file {token_file}: no token in it")
        if (cert is None) != (key is None):
            raise UserError("--rpc-tls-cert and --rpc-tls-key go together")
        return cls(tokens, client, _read(ca, "--rpc-tls-ca") if ca else None,
                   _read(cert, "--rpc-tls-cert") if cert else None, _read(key, "--rpc-tls-key") if key else None,
                   insecure)

    # ---- server side --------------------------------------------------------------------
    def add_port(self, server: grpc.aio.Server, host: str, port: int, flag: str = "--port") -> int:
        """Binds host:port with TLS when a certificate is given; refuses an open port, and
        a taken one with one error line (common/ports.add_grpc_port)."""
        if not self.tokens and self.cert is None and not self.insecure and not is_loopback(host):
            raise UserError(f"refusing to listen on {host}:{port} without authentication: give "
                            f"--rpc-token-file (or ${TOKEN_ENV}) and/or TLS, or --insecure-rpc")
        credentials = None
        if self.cert is not None:
            credentials = grpc.ssl_server_credentials(
                [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None)
        return add_grpc_port(server, host, port, flag, credentials)

    def interceptors(self) -> list:
        return [_TokenInterceptor(self.tokens)] if self.tokens else []

    # ---- client side --------------------------------------------------------------------
    def channel(self, address: str) -> grpc.aio.Channel:
        if self.ca is not None or self.cert is not None:
            credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
            return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

    def sync_channel(self, address: str) -> grpc.Channel:
        if self.ca is not None or self.cert is not None:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.ca, self.key, self.cert),
                                       options=CHANNEL_OPTIONS)
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)

    def caller(self, context) -> str:
        """The authenticated caller of a call: the owner of what the call starts."""
        return caller_name(self.tokens, context.invocation_metadata()) or ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.client_token}"),) if self.client_token else ()


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        if caller_name(self.tokens, details.invocation_metadata) is None:
            return _refuse("missing or invalid RPC token (authorization: Bearer <token>)")
        return await continuation(details)


def caller_name(tokens: dict[str, str], metadata) -> str | None:
    """The caller's name from its token; "" when no tokens are configured; None: refused."""
    if not tokens:
        return ""
    given = ""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            given = value[len("Bearer "):]
    for token, name in tokens.items():  # constant time per entry: no timing oracle
        if hmac.compare_digest(token.encode(), given.encode()):
            return name
    return None


def _refuse(message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # answered before any message is read or sent, so a unary handler also ends a
    # streaming call with this status
    return grpc.unary_unary_rpc_method_handler(unary)


def _check_token(token: str, name: str, where: str) -> None:
    if len(token) < 16 or not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise UserError(f"{where}: the token must be at least 16 visible ASCII characters")
    if not _NAME.fullmatch(name):
        raise UserError(f"{where}: caller name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot read it ({err.strerror})") from None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
