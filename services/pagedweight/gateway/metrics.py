"""The gateway's /metrics: vLLM's request-level families, seen from the client's side.

Names, types and buckets are vLLM's (from `pagedweight.common.metrics`, shared with the
workers). The `engine` label is "gateway", so a dashboard that sums a model's workers
can leave the gateway's series out (`engine!="gateway"`) and one that wants the latency a
client sees (queueing, routing and detokenisation included) can select them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedweight.common.metrics import RequestMetrics

ENGINE = "gateway"


class GatewayMetrics(RequestMetrics):
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        super().__init__(registry, model_name, max_model_len, ENGINE)
        self.num_requests_running = self._families.gauge("vllm:num_requests_running",
                                                         "Requests this gateway is serving now.")
        # ours
        self.retries = Counter("pagedweight:gateway_retries",
                               "Choices retried on another worker after one failed before its first token.",
                               registry=registry)
        self.rejected = Counter("pagedweight:gateway_rejected",
                                "Requests answered 503, by why.", ("reason",), registry=registry)
        self.workers_ready = Gauge("pagedweight:gateway_workers_ready",
                                   "Workers answering and ready, as this gateway sees them.", registry=registry)
        self.session_store = Gauge("pagedweight:session_store",
                                   "1 for the session store in use (redis, or memory: sessions not shared).",
                                   ("backend",), registry=registry)
