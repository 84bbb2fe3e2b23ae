"""The memory split of one worker runtime over time, sampled once per engine step.

`pagedweight bench engine --plot FILE.png` records one `MemorySample` after every step of the
load (and of the drain after it, when the weights take their bytes back) and draws them with
`memory_plot.plot_memory_timeline`. A sample reads the pool's snapshot (bytes by kind), the
scheduler's preemption count and the pager's page-move count: counters, so the plot can mark
where each preemption and page move happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedweight.format.apl_format import BIT_WIDTHS


@dataclass(frozen=True)
class MemorySample:
    t_s: float  # seconds since the timeline started
    expert_bytes_by_bits: dict[int, int]  # bits -> bytes of expert blocks committed at bits
    dense_bytes: int  # embeddings, attention, norms, routers, shared experts
    workspace_bytes: int
    transit_bytes: int  # planes being copied in, not yet committed
    kv_used_bytes: int
    kv_free_bytes: int
    free_bytes: int  # budget not reserved by anything
    num_preemptions: int  # so far
    num_page_moves: int  # committed bit changes so far
    mean_bits: float  # committed bits per expert weight


@dataclass
class MemoryTimeline:
    budget_bytes: int = 0
    samples: list[MemorySample] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter)

    def record(self, runtime) -> None:
        from pagedweight.cli.load_bench import mean_committed_bits

        pool = runtime.pool.snapshot()
        self.budget_bytes = pool.budget_bytes
        moves = runtime.pager.stats().num_page_moves if runtime.pager is not None else 0
        self.samples.append(MemorySample(
            t_s=time.perf_counter() - self._start,
            expert_bytes_by_bits={b: pool.expert_bytes_by_bits.get(b, 0) for b in BIT_WIDTHS},
            dense_bytes=pool.other_weight_bytes,
            workspace_bytes=pool.workspace_bytes,
            transit_bytes=pool.transit_bytes,
            kv_used_bytes=pool.kv_used_bytes,
            kv_free_bytes=pool.kv_free_bytes,
            free_bytes=pool.free_bytes,
            num_preemptions=runtime.engine.scheduler.num_preemptions,
            num_page_moves=moves,
            mean_bits=mean_committed_bits(runtime),
        ))

    def event_times(self, counter: str) -> list[float]:
        """Times of the samples at which `counter` (num_preemptions / num_page_moves) rose,
        once per unit it rose by."""
        times = []
        for prev, cur in zip(self.samples, self.samples[1:]):
            times += [cur.t_s] * (getattr(cur, counter) - getattr(prev, counter))
        return times
