"""The gateway's /metrics: vLLM's request-level families, seen from the client's side.

Names, types and buckets are vLLM's (from `pagedweight.common.metrics`, shared with the
workers). The `engine` label is "gateway", so a dashboard that sums a model's workers
can leave the gateway's series out (`engine!="gateway"`) and one that wants the latency a
client sees (queueing, routing and detokenisation included) can select them.

The workers' engine gauges (running and waiting requests, KV usage, the memory split,
bits, the planner link) are served here too, one series per worker (`engine` = its
address), as each last answered GetStats: a router or dashboard pointed at the API port
finds them, as at vLLM's. A worker that stops answering loses its series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedweight.common.metrics import LABELS, MEMORY_COMPONENTS, RequestMetrics
from pagedweight.format.blocks import BIT_WIDTHS

ENGINE = "gateway"


class GatewayMetrics(RequestMetrics):
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        super().__init__(registry, model_name, max_model_len, ENGINE)
        self.model_name = model_name
        running = Gauge("vllm:num_requests_running", "Requests being served now (engine=\"gateway\": "
                        "by this gateway; engine=<worker address>: in that worker's batches).", LABELS,
                        registry=registry)
        self.num_requests_running = running.labels(model_name=model_name, engine=ENGINE)
        # the workers' engine gauges, engine=<worker address>, from their last GetStats
        self._worker_gauges = {
            "running": running,
            "waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             LABELS, registry=registry),
            "kv_usage": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              LABELS, registry=registry),
            "budget": Gauge("pagedweight:budget_bytes", "The worker's device memory budget.", LABELS,
                            registry=registry),
            "memory": Gauge("pagedweight:gpu_memory_bytes", "Device budget bytes by what holds them (they add "
                            "up to pagedweight:budget_bytes).", LABELS + ("component", "bits"), registry=registry),
            "bits": Gauge("pagedweight:mean_expert_bits", "Committed bits per expert weight (blocks weighted "
                          "by size).", LABELS, registry=registry),
            "planner": Gauge("pagedweight:planner_connected", "1 while the planner service answers, 0 when "
                             "down or not configured.", LABELS, registry=registry),
        }
        self._worker_series: set[str] = set()  # worker addresses with series now
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

    def observe_workers(self, stats_by_address: dict) -> None:
        """The workers' gauges as their last GetStats gave them (worker address -> WorkerStats,
        None for a worker that did not answer: its series are dropped, not left stale)."""
        g = self._worker_gauges
        for address, stats in stats_by_address.items():
            labels = dict(model_name=self.model_name, engine=address)
            if stats is None:
                if address in self._worker_series:
                    self._worker_series.discard(address)
                    self._remove(address)
                continue
            self._worker_series.add(address)
            load, memory = stats.load, stats.memory
            g["running"].labels(**labels).set(load.num_running)
            g["waiting"].labels(**labels).set(load.num_waiting)
            g["kv_usage"].labels(**labels).set(load.kv_cache_usage_perc)
            g["budget"].labels(**labels).set(memory.budget_bytes)
            g["bits"].labels(**labels).set(stats.bits.mean_expert_bits)
            g["planner"].labels(**labels).set(int(stats.planner_connected))
            parts = dict(dense_weights=memory.dense_weight_bytes, kv_used=memory.kv_used_bytes,
                         kv_free=memory.kv_free_bytes, in_transit=memory.in_transit_bytes,
                         workspace=memory.workspace_bytes, free=memory.free_bytes)
            for component in MEMORY_COMPONENTS:
                g["memory"].labels(component=component, bits="", **labels).set(parts[component])
            for bits, nbytes in memory.expert_bytes_by_bits.items():
                g["memory"].labels(component="expert_weights", bits=str(bits), **labels).set(nbytes)


    def _remove(self, address: str) -> None:
        values = (self.model_name, address)
        for name, gauge in self._worker_gauges.items():
            splits = ([(c, "") for c in MEMORY_COMPONENTS] + [("expert_weights", str(b)) for b in BIT_WIDTHS]
                      if name == "memory" else [()])
            for extra in splits:
                try:
                    gauge.remove(*values, *extra)
                except KeyError:  # a split this worker never reported
                    pass
