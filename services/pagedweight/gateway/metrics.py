"""The gateway's /metrics: vLLM's request-level families, seen from the client's side.

Names, types and buckets are vLLM's (from `pagedweight.common.metrics`, shared with the
workers). The `engine` label is "gateway", so a dashboard that sums a model's workers
can leave the gateway's series out (`engine!="gateway"`) and one that wants the latency a
client sees (queueing, routing and detokenisation included) can select them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedweight.common.metrics import (
    FINISH_REASONS, ITL_BUCKETS, LABELS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, build_1_2_5_buckets,
)

ENGINE = "gateway"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        labels = dict(model_name=model_name, engine=ENGINE)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(**labels)

        def counter(name, doc):  # prometheus-client appends _total
            return Counter(name, doc, LABELS, registry=registry).labels(**labels)

        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Requests this gateway is serving now.",
            LABELS, registry=registry).labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ("finished_reason",), registry=registry)
        self.request_success = {r: success.labels(finished_reason=r, **labels) for r in FINISH_REASONS}
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
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
