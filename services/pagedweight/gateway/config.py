"""The gateway's settings: one frozen dataclass, checked at construction."""

from __future__ import annotations

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
    redis_url: str = DEFAULT_REDIS_URL  # sessions; an in-process store when Redis does not answer
    session_key_prefix: str = "pagedweight:"  # Redis keys are <prefix>session:<id>
    session_ttl_s: float = 3600.0  # a session expires this long after its last request
    max_queued_requests: int = 256  # requests in flight at this gateway before it answers 503
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
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
        if self.session_ttl_s <= 0:
            raise UserError(f"--session-ttl must be > 0 seconds, got {self.session_ttl_s}")
        if self.stats_interval_s <= 0:
            raise UserError(f"--stats-interval must be > 0 seconds, got {self.stats_interval_s}")
        if self.max_body_bytes < 1024:
            raise UserError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not (Path(self.model_dir) / "tokenizer.json").is_file():
            raise UserError(f"--model {self.model_dir}: no tokenizer.json there")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name
