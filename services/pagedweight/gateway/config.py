"""The gateway's settings: one frozen dataclass, checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import UserError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path  # the served model's directory: tokenizer.json, tokenizer_config.json, config.json
    workers: tuple[str, ...]  # gRPC addresses of the workers, "host:port"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the `model` clients send; default: the directory name
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    api_keys_file: str | None = None  # `tenant:sha256hex` lines: keys by digest (gateway/tenants.py)
    rate_limit_rps: float | None = None  # requests/s per tenant (a token bucket); None: no limit
    rate_limit_burst: int | None = None  # the bucket's size; None: the rate rounded up
    redis_url: str = DEFAULT_REDIS_URL  # sessions; an in-process store when Redis does not answer
    session_key_prefix: str = "pagedweight:"  # Redis keys are <prefix>session:<id>
    session_ttl_s: float = 3600.0  # a session expires this long after its last request
    max_queued_requests: int = 256  # requests in flight at this gateway before it answers 503
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_header_bytes: int = 32 << 10  # larger request headers (all together) get 431
    header_timeout_s: float = 10.0  # a connection's request headers must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this (408)
    max_prompt_chars: int = 1 << 20  # a prompt (or rendered chat) longer than this gets 413
    template_timeout_s: float = 5.0  # longest a chat template may render or a prompt tokenise
    text_workers: int = 2  # processes that render templates and tokenise prompts (isolated)
    rpc_token_file: str | None = None  # the token the workers require (common/rpc_security.py)
    rpc_tls_ca: str | None = None  # CA that signed the workers' certificates: TLS to the workers
    rpc_tls_cert: str | None = None  # this gateway's client certificate and key (mTLS)
    rpc_tls_key: str | None = None
    stats_interval_s: float = 0.5  # how often worker readiness and load are polled
    worker_timeout_s: float = 600.0  # longest a single worker call may take

    def __post_init__(self):
        if not self.workers:
            raise UserError("--workers: give at least one worker address (host:port)")
        for addr in self.workers:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise UserError(f"--workers: {addr!r} is not host:port")
        if not 0 < self.port < 65536:
            raise UserError(f"--port must be in 1..65535, got {self.port}")
        if self.max_queued_requests < 1:
            raise UserError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        # `not x > 0` also refuses NaN
        for flag, value in (("--session-ttl", self.session_ttl_s), ("--stats-interval", self.stats_interval_s),
                            ("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s),
                            ("--template-timeout", self.template_timeout_s),
                            ("--worker-timeout", self.worker_timeout_s)):
            if not (value > 0 and math.isfinite(value)):
                raise UserError(f"{flag} must be a finite number of seconds > 0, got {value}")
        if self.rate_limit_rps is not None and not (self.rate_limit_rps > 0 and math.isfinite(self.rate_limit_rps)):
            raise UserError(f"--rate-limit must be a finite number of requests/s > 0, got {self.rate_limit_rps}")
        if self.rate_limit_burst is not None and self.rate_limit_burst < 1:
            raise UserError(f"--rate-limit-burst must be >= 1, got {self.rate_limit_burst}")
        if self.max_body_bytes < 1024:
            raise UserError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise UserError(f"--max-header-bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_prompt_chars < 1:
            raise UserError(f"--max-prompt-chars must be >= 1, got {self.max_prompt_chars}")
        if not 1 <= self.text_workers <= 64:
            raise UserError(f"--text-workers must be in 1..64, got {self.text_workers}")
        if (self.rpc_tls_cert is None) != (self.rpc_tls_key is None):
            raise UserError("--rpc-tls-cert and --rpc-tls-key go together")
        if not (Path(self.model_dir) / "tokenizer.json").is_file():
            raise UserError(f"--model {self.model_dir}: no tokenizer.json there")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name
