"""Prometheus metric families of every service: names, types, labels and buckets, once.

The `vllm:` families copy vLLM's names, types, labels (`model_name`, `engine`) and bucket
boundaries exactly (its v1 `PrometheusStatLogger`), so vLLM's Grafana dashboards, the
production-stack router and the inference gateway's endpoint picker read our workers
unchanged. What vLLM has no name for uses our own `pagedweight:` prefix.

Each class below creates its families in one `CollectorRegistry` (one per service, never
the global default, so tests can run several services in one process) and binds the
label values; the services only call `.set`, `.inc`, `.observe` on the bound children.
Torch-free: the gateway and the planner service import it too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics

disable_created_metrics()  # no `*_created` series: vLLM's scrapes have none, dashboards ignore them

LABELS = ("model_name", "engine")  # vLLM's labels on every engine-level family
FINISH_REASONS = ("stop", "length", "abort", "error")  # vllm:request_success{finished_reason}
BIT_WIDTHS = (3, 4, 5, 6, 7, 8)  # expert bit-widths (the APL format's; no torch import here)

# vLLM's bucket boundaries, seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Our plan latencies are milliseconds, not requests: finer at the low end.
PLAN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The body and content type of a /metrics answer."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Families:
    """Makes families bound to one (model_name, engine) label pair."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str):
        self.registry, self.labels = registry, dict(model_name=model_name, engine=engine)

    def gauge(self, name, doc):
        return Gauge(name, doc, LABELS, registry=self.registry).labels(**self.labels)

    def counter(self, name, doc):  # name without _total: prometheus-client appends it
        return Counter(name, doc, LABELS, registry=self.registry).labels(**self.labels)

    def histogram(self, name, doc, buckets):
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(**self.labels)


class RequestMetrics:
    """vLLM's request-level families: what a worker and a gateway both observe per request
    (the gateway from the client's side, under engine="gateway")."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, engine: str):
        f = self._families = _Families(registry, model_name, engine)
        self.prompt_tokens = f.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = f.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ("finished_reason",), registry=registry)
        self.request_success = {r: success.labels(finished_reason=r, **f.labels) for r in FINISH_REASONS}
        self.time_to_first_token = f.histogram("vllm:time_to_first_token_seconds",
                                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = f.histogram("vllm:inter_token_latency_seconds",
                                               "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = f.histogram("vllm:e2e_request_latency_seconds",
                                               "Histogram of e2e request latency in seconds.",
                                               REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = f.histogram("vllm:request_prompt_tokens",
                                                 "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = f.histogram("vllm:request_generation_tokens",
                                                     "Number of generation tokens processed.", token_buckets)


class EngineMetrics(RequestMetrics):
    """vLLM's engine-level families, bound to one model and engine index."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 engine: str = "0"):
        super().__init__(registry, model_name, max_model_len, engine)
        f = self._families
        self.num_requests_running = f.gauge("vllm:num_requests_running",
                                            "Number of requests in model execution batches.")
        self.num_requests_waiting = f.gauge("vllm:num_requests_waiting",
                                            "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = f.gauge("vllm:kv_cache_usage_perc",
                                           "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = f.counter("vllm:num_preemptions",
                                         "Cumulative number of preemption from the engine.")
        self.request_queue_time = f.histogram("vllm:request_queue_time_seconds",
                                              "Histogram of time spent in WAITING phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self._cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 ("block_size", "num_gpu_blocks", "engine"), registry=registry)
        self._engine = engine
        self._cache_info_labels: tuple | None = None

    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        """vllm:cache_config_info (value 1); a change of blocks replaces the old series."""
        key = (str(block_size), str(num_gpu_blocks), self._engine)
        if key == self._cache_info_labels:
            return
        if self._cache_info_labels is not None:
            self._cache_info.remove(*self._cache_info_labels)
        self._cache_info.labels(*key).set(1)
        self._cache_info_labels = key


# `pagedweight:gpu_memory_bytes{component}` values besides expert_weights (which has `bits`).
MEMORY_COMPONENTS = ("dense_weights", "kv_used", "kv_free", "in_transit", "workspace", "free")
PLAN_SOURCES = ("service", "local")
MOVE_DIRECTIONS = ("raise", "lower")


class WorkerMetrics:
    """Our `pagedweight:` families of a worker: the memory split, bits, plans, planner link."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0"):
        labels = dict(model_name=model_name, engine=engine)
        self._labels = labels
        memory = Gauge("pagedweight:gpu_memory_bytes",
                       "Device budget bytes by what holds them (they add up to pagedweight:budget_bytes).",
                       LABELS + ("component", "bits"), registry=registry)
        self.expert_weight_bytes = {b: memory.labels(component="expert_weights", bits=str(b), **labels)
                                    for b in BIT_WIDTHS}  # bits -> gauge
        self.memory_bytes = {c: memory.labels(component=c, bits="", **labels) for c in MEMORY_COMPONENTS}
        self.budget_bytes = Gauge("pagedweight:budget_bytes", "The worker's device memory budget.",
                                  LABELS, registry=registry).labels(**labels)
        self.kv_capacity_blocks = Gauge(
            "pagedweight:kv_capacity_blocks",
            "KV blocks the budget could hold with every expert block at its floor bits "
            "(vllm:kv_cache_usage_perc is relative to the blocks allocated now).",
            LABELS, registry=registry).labels(**labels)
        self.kv_reclaimable_bytes = Gauge(
            "pagedweight:kv_reclaimable_bytes",
            "Bytes that lowering expert bits to their floor could still free for KV.",
            LABELS, registry=registry).labels(**labels)
        self.expert_bits = Gauge("pagedweight:expert_bits", "Committed bits of each expert block.",
                                 LABELS + ("layer", "expert", "module"), registry=registry)
        self.mean_expert_bits = Gauge("pagedweight:mean_expert_bits",
                                      "Committed bits per expert weight (blocks weighted by size).",
                                      LABELS, registry=registry).labels(**labels)
        moves = Counter("pagedweight:page_moves", "Committed expert bit changes.",
                        LABELS + ("direction",), registry=registry)
        self.page_moves = {d: moves.labels(direction=d, **labels) for d in MOVE_DIRECTIONS}
        plans = Counter("pagedweight:plans", "Bit plans applied, by who made them.",
                        LABELS + ("source",), registry=registry)
        self.plans = {s: plans.labels(source=s, **labels) for s in PLAN_SOURCES}
        self.plan_latency = Histogram("pagedweight:plan_latency_seconds",
                                      "Time from asking for a plan to having it, by source.",
                                      LABELS + ("source",), buckets=PLAN_LATENCY_BUCKETS, registry=registry)
        self.planner_connected = Gauge("pagedweight:planner_connected",
                                       "1 while the planner service answers, 0 when down or not configured.",
                                       LABELS, registry=registry).labels(**labels)
        self.planner_reconnects = Counter("pagedweight:planner_reconnects",
                                          "Times the worker re-registered with the planner service.",
                                          LABELS, registry=registry).labels(**labels)
        self.planner_errors = Counter("pagedweight:planner_errors",
                                      "Planner service calls that failed (the local planner answered).",
                                      LABELS + ("reason",), registry=registry)

    def planner_error(self, reason: str) -> None:
        """reason: unavailable | deadline | not_registered | garbage | other"""
        self.planner_errors.labels(reason=reason, **self._labels).inc()

    def set_expert_bits(self, layer: int, expert: int, module: str, bits: int) -> None:
        self.expert_bits.labels(layer=str(layer), expert=str(expert), module=module, **self._labels).set(bits)


class PlannerServiceMetrics:
    """The planner service's families (no model/engine labels: it serves many workers)."""

    def __init__(self, registry: CollectorRegistry):
        self.plans = Counter("pagedweight:planner_plans", "Plans answered, by direction.",
                             ("direction",), registry=registry)
        self.plan_latency = Histogram("pagedweight:planner_plan_latency_seconds",
                                      "Time to compute one plan.", buckets=PLAN_LATENCY_BUCKETS,
                                      registry=registry)
        self.bytes_moved = Counter("pagedweight:planner_bytes_moved",
                                   "Bytes of expert weights the answered plans change, by direction.",
                                   ("direction",), registry=registry)
        self.workers_registered = Gauge("pagedweight:planner_workers_registered",
                                        "Workers with a registered block table.", registry=registry)
        self.refused = Counter("pagedweight:planner_requests_refused", "Requests refused, by gRPC status code.",
                              ("code",), registry=registry)
        self.dial_min_mean_bits = Gauge("pagedweight:planner_dial_min_mean_bits",
                                        "The operator's quality floor in mean expert bits (0: none).",
                                        registry=registry)
        self.dial_target_itl = Gauge("pagedweight:planner_dial_target_itl_seconds",
                                     "The operator's inter-token latency target (0: none).", registry=registry)
        self.dial_limited = Counter("pagedweight:planner_dial_limited",
                                    "Plan requests the dial cut (floor) or held (latency), by reason.",
                                    ("reason",), registry=registry)
