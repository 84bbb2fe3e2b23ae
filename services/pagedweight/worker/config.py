"""The worker service's settings, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import UserError


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str  # a paged model directory (pagedweight quantize)
    port: int = 50051  # gRPC port (0: any free port)
    host: str = "127.0.0.1"  # interface to listen on ("0.0.0.0" in a container)
    http_port: int | None = None  # /metrics, /health, /ready; None: no HTTP side port
    memory_budget: str = "256MiB"  # bytes, or a fraction of the GPU ("0.9")
    policy: str = "pagedweight"  # planner policy, or static-B
    prompt_residuals: bool = False  # feed prompts through the artifact's residual heads (opt-in)
    device: str = "cpu"
    dtype: str | None = None  # float32 / bfloat16 / float16; None: float32 on CPU, bfloat16 on CUDA
    served_model_name: str | None = None  # the model's name in APIs and metrics (default: directory name)
    planner_address: str | None = None  # host:port of the planner service; None: in-process only
    planner_deadline_s: float = 0.25  # the longest a step boundary waits for the service's plan
    worker_id: str | None = None  # name at the planner service (default host:port)
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long running requests may take to finish
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16  # tokens per KV block
    threads: int = 1  # torch CPU threads
    # meet every decode bucket before readiness (CUDA graphs: the first step at a bucket
    # compiles and captures); a no-op where steps are eager (the CPU)
    warm_up: bool = True
    # every step eager, no CUDA graphs (vLLM's --enforce-eager): for debugging a graph
    # capture or comparing against it; slower at small batches
    enforce_eager: bool = False
    # internal RPC security (common/rpc_security.py): the token file callers must present
    # (also the one sent to the planner service), TLS certificate/key, and the CA that
    # client certificates must chain to (mutual TLS) and the planner's certificate is checked against
    rpc_token_file: str | None = None
    rpc_tls_cert: str | None = None
    rpc_tls_key: str | None = None
    rpc_tls_ca: str | None = None
    insecure_rpc: bool = False  # allow an unauthenticated port on a non-loopback interface

    def __post_init__(self):
        if not Path(self.model_dir).is_dir():
            raise UserError(f"--model {self.model_dir}: not a directory")
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise UserError(f"--{name.replace('_', '-')} must be in 0..65535, got {value}")
        # `not x > 0` also refuses NaN
        if not (0 < self.planner_deadline_s < 3600):
            raise UserError(f"--planner-deadline must be > 0 and < 3600 seconds, got {self.planner_deadline_s}")
        if not (0 <= self.shutdown_timeout_s <= 30 * 24 * 3600):
            raise UserError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {self.shutdown_timeout_s}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    def security(self):
        from pagedweight.common.rpc_security import RpcSecurity

        return RpcSecurity.from_settings(self.rpc_token_file, self.rpc_tls_ca, self.rpc_tls_cert, self.rpc_tls_key,
                                         self.insecure_rpc)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name
