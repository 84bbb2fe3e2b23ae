"""What the worker measures: per-request latencies and counts, and the engine's gauges.

Per request (from the servicer, on the event loop): TTFT from arrival at the servicer to
the first token, inter-token latency between later tokens, e2e latency, token counts
and the finish reason, in vLLM's families; the mean committed expert bits over the
steps that produced its tokens. Engine-wide (on each /metrics scrape and GetStats): the
engine's latest stats snapshot and the page table, into vLLM's gauges and our
`pagedweight:` families.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedweight.common.metrics import BIT_WIDTHS, EngineMetrics, WorkerMetrics
from pagedweight.worker import convert


@dataclass
class RequestRecord:
    request_id: str
    num_prompt_tokens: int
    arrived: float  # time.monotonic()
    metrics: EngineMetrics
    num_tokens: int = 0
    last_token_at: float | None = None
    bits_sum: float = 0.0  # sum over token-producing steps of the mean committed bits
    num_bit_samples: int = 0

    def queued(self, seconds: float) -> None:
        """The engine's arrival-to-first-scheduled time of this request."""
        self.metrics.request_queue_time.observe(seconds)

    def tokens(self, n: int, mean_bits: float) -> None:
        if n == 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - self.last_token_at)
        self.last_token_at = now
        self.num_tokens += n
        self.metrics.generation_tokens.inc(n)
        self.bits_sum += mean_bits
        self.num_bit_samples += 1

    @property
    def mean_bits(self) -> float:
        return self.bits_sum / self.num_bit_samples if self.num_bit_samples else 0.0


@dataclass
class WorkerTelemetry:
    runtime: object  # runtime.WorkerRuntime
    engine: object  # AsyncEngine
    vllm: EngineMetrics
    ours: WorkerMetrics
    planner: object | None = None  # RemotePlanner, or None (in-process planner only)
    _seen: dict = field(default_factory=lambda: {"preemptions": 0, "raises": 0, "lowerings": 0,
                                                  "local_plans": 0})
    num_prompt_tokens: int = 0

    def __post_init__(self):
        counters = self.runtime.mover.counters  # the initial load is not a page move
        self._seen["raises"], self._seen["lowerings"] = counters.num_raises_committed, counters.num_lowerings
        self._seen_at_start = counters.num_raises_committed + counters.num_lowerings
        pager = self.runtime.pager
        self._seen["local_plans"] = pager.num_plans if pager is not None else 0
        entries = self.runtime.table.entries.values()  # a static policy's bits never change
        weights = sum(e.num_weights for e in entries)
        self._static_mean_bits = sum(e.committed_bits * e.num_weights for e in entries) / max(weights, 1)

    # ---- per request ---------------------------------------------------------------------
    def start(self, request_id: str, num_prompt_tokens: int, arrived: float) -> RequestRecord:
        self.vllm.prompt_tokens.inc(num_prompt_tokens)
        self.num_prompt_tokens += num_prompt_tokens
        return RequestRecord(request_id, num_prompt_tokens, arrived, self.vllm)

    def finish(self, record: RequestRecord, finish_reason: str) -> None:
        self.vllm.request_success[finish_reason].inc()
        self.vllm.e2e_request_latency.observe(time.monotonic() - record.arrived)
        self.vllm.request_prompt_tokens.observe(record.num_prompt_tokens)
        self.vllm.request_generation_tokens.observe(record.num_tokens)

    def mean_expert_bits(self) -> float:
        pager = self.engine.stats().pager
        return self._static_mean_bits if pager is None else pager["mean_committed_bits"]

    # ---- engine-wide ---------------------------------------------------------------------
    def kv_reclaimable_bytes(self) -> int:
        """Arena bytes freed if every expert block went down to the lowest bit-width."""
        table = self.runtime.table
        if self.runtime.pager is None:
            return 0  # a static policy never moves
        floor = min(BIT_WIDTHS)
        return sum(table.charged_bytes(bid, e.committed_bits) - table.charged_bytes(bid, floor)
                   for bid, e in table.entries.items() if e.committed_bits > floor)

    def plan_counts(self) -> tuple[int, int]:
        """(plans by the service, plans in process)."""
        pager = self.runtime.pager
        if pager is None:
            return 0, 0
        if self.planner is None:
            return 0, pager.num_plans
        return self.planner.num_service_plans, self.planner.num_local_plans

    def fill_stats(self, message) -> None:
        stats = self.engine.stats()
        service, local = self.plan_counts()
        message.load.CopyFrom(convert.load_stats(stats, self.runtime.engine.max_kv_blocks or 0,
                                                 self.num_prompt_tokens))
        message.memory.CopyFrom(convert.memory_split(stats.pool, self.kv_reclaimable_bytes()))
        histogram = {b: 0 for b in BIT_WIDTHS}  # bits -> blocks committed at bits
        for entry in self.runtime.table.entries.values():
            if entry.committed_bits:
                histogram[entry.committed_bits] += 1
        counters = self.runtime.mover.counters
        moves = counters.num_raises_committed + counters.num_lowerings - self._seen_at_start
        message.bits.CopyFrom(convert.bits_stats(self.mean_expert_bits(), histogram, moves, service, local))
        message.planner_connected = self.planner is not None and self.planner.connected

    def refresh(self) -> None:
        """Gauges and counters from the engine's latest snapshot (before a scrape)."""
        stats = self.engine.stats()
        v, o = self.vllm, self.ours
        v.num_requests_running.set(stats.num_running)
        v.num_requests_waiting.set(stats.num_waiting)
        v.kv_cache_usage_perc.set(convert.kv_cache_usage(stats))
        # the KV blocks the budget can hold (with every expert at its floor bits), a constant
        # like vLLM's num_gpu_blocks; the blocks allocated at a moment (0 on an idle worker
        # whose weights took the bytes back) are no configuration
        v.set_cache_config(stats.kv_block_size, self.runtime.engine.max_kv_blocks or stats.kv_num_blocks)
        self._count(v.num_preemptions, "preemptions", stats.num_preemptions)
        pool = stats.pool
        if pool is not None:
            for bits in BIT_WIDTHS:
                o.expert_weight_bytes[bits].set(pool["expert_bytes_by_bits"].get(str(bits), 0))
            split = {"dense_weights": pool["other_weight_bytes"], "kv_used": pool["kv_used_bytes"],
                     "kv_free": pool["kv_free_bytes"], "in_transit": pool["transit_bytes"],
                     "workspace": pool["workspace_bytes"], "free": pool["budget_bytes"] - pool["reserved_bytes"]}
            for component, value in split.items():
                o.memory_bytes[component].set(value)
            o.budget_bytes.set(pool["budget_bytes"])
        o.kv_capacity_blocks.set(self.runtime.engine.max_kv_blocks or 0)
        o.kv_reclaimable_bytes.set(self.kv_reclaimable_bytes())
        for bid, entry in self.runtime.table.entries.items():
            o.set_expert_bits(bid.layer, bid.expert, bid.module, entry.committed_bits)
        o.mean_expert_bits.set(self.mean_expert_bits())
        counters = self.runtime.mover.counters
        self._count(o.page_moves["raise"], "raises", counters.num_raises_committed)
        self._count(o.page_moves["lower"], "lowerings", counters.num_lowerings)
        if self.planner is None:  # the remote planner counts its own plans as they happen
            self._count(o.plans["local"], "local_plans", self.plan_counts()[1])
        o.planner_connected.set(1 if self.planner is not None and self.planner.connected else 0)

    def _count(self, counter, key: str, total: int) -> None:
        """Advance a Prometheus counter to a cumulative total the engine keeps."""
        if total > self._seen[key]:
            counter.inc(total - self._seen[key])
            self._seen[key] = total
