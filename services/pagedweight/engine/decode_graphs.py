"""CUDA-graph replay of decode steps, per padded batch bucket (issue 12).

At real sizes a decode step is bound by the host issuing ~1,500 small operators, not by
the GPU (docs/real_shape.md). A decode step's work has a fixed shape once its batch is
padded to a bucket, so it is captured once per bucket and replayed: one launch instead of
thousands.

What makes a replay valid for any step of its bucket:
- Inputs live in static device buffers. Each step's host values (token ids, positions,
  KV slot offsets, context lengths, block tables padded to the model's longest context)
  go into one pinned host mirror and cross in one non-blocking copy into the rows the
  bucket reads. Padding rows repeat row 0: they compute what row 0 computes and write the
  same KV values to the same slot, so they disturb nothing and need no scratch block.
- Attention is the `inplace` path (model/paged_attention.py): it reads the cache through
  tile offsets computed on the device from the block-table buffer, and loops to each
  sequence's own length, so one graph serves every length up to the model's context.
- The experts operators say what their launches depend on through `graph_state(dtype)`: it
  brings device-side state up to date in place (the fused kernel's descriptor rows after
  the pager moved pages) and returns the host-side choices a capture bakes in (bit
  classes, widest bits). A bucket is captured again when that signature changes, and an
  operator that returns None (or has no such method) keeps the step eager. The routing
  observer's identity is part of the signature: its device-side counters are captured.
- Steps with a prefill chunk, more sequences than the largest bucket, or a sequence that
  does not sample run eagerly.

`capture=False` runs the same static-buffer plumbing without capturing (the CPU tests
check padding and buffers against the eager engine that way).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from pagedweight.engine.step_phases import StepPhases
from pagedweight.memory.kv_cache import PagedKVCache
from pagedweight.model.paged_attention import PagedStep
from pagedweight.model.transformer import MoECausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_FIELDS = 4  # per row: input id, position, new KV offset, context length; then the block table


def buckets_up_to(max_batch: int, buckets=DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a batch of at most max_batch sequences can use (max_batch itself last)."""
    chosen = tuple(b for b in buckets if b < max_batch)
    return chosen + (max_batch,)


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n sequences; None when n exceeds them all."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class DecodeRow:
    """One sequence of a decode step, as the host knows it."""

    token_id: int  # the input token
    block_ids: list[int]  # its block table (RELEASED entries stay negative)
    context_len: int  # tokens in the cache after this step (its position + 1)


class DecodeGraphs:
    def __init__(self, model: MoECausalLM, kv: PagedKVCache, max_batch: int,
                 buckets: tuple[int, ...] | None = None, capture: bool | None = None,
                 graphs_per_bucket: int = 1):
        if graphs_per_bucket < 1:
            raise ValueError(f"graphs_per_bucket must be >= 1, got {graphs_per_bucket}")
        self.model, self.kv = model, kv
        # Graphs kept per bucket, one per signature, least recently used dropped first: a pager
        # that lowers bits under pressure and raises them back returns to signatures it has
        # captured before, and replaying a kept graph costs nothing where a capture costs a
        # warm-up step and the capture itself. Each kept graph holds its outputs (logits).
        self.graphs_per_bucket = graphs_per_bucket
        self.buckets = buckets_up_to(max_batch) if buckets is None else tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self.capture = kv.device.type == "cuda" if capture is None else capture
        self.width = -(-model.config.max_position_embeddings // kv.block_size)  # table columns
        row = _FIELDS + self.width
        self.static = torch.zeros(self.max_batch, row, dtype=torch.int64, device=kv.device)
        pin = kv.device.type == "cuda"
        self.host = torch.zeros(self.max_batch, row, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()  # the same memory: rows are filled without torch dispatch
        self.rows = torch.arange(self.max_batch, device=kv.device)  # logits rows: all of them
        # bucket -> {sig: (graph, (logits, greedy tokens))}, most recently used last
        self.graphs: dict[int, OrderedDict[tuple, tuple[object, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.pool = None
        self.num_captures = self.num_replays = 0
        self.steps_per_bucket: Counter = Counter()  # bucket -> decode steps it served
        self.capture_seconds = 0.0  # host time in captures, warm-up included (a step waits for it)
        self.capture_warmup_seconds = 0.0  # of which the eager warm-up step before each capture
        self.disabled = False  # a capture failed: every step eager
        self.replay_events: list | None = None  # a list: (bucket, start, end) CUDA events per replay

    # ---- when a step can replay ------------------------------------------------------
    def signature(self) -> tuple | None:
        """What captured graphs depend on beyond the buffers; None: not capturable now."""
        parts = []
        for block in self.model.moe_blocks:
            state = getattr(block.experts, "graph_state", None)
            state = state(self.model.dtype) if state is not None else None
            if state is None:
                return None
            parts.append((id(block.observer), state))
        return tuple(parts)

    def fits(self, rows: list[DecodeRow]) -> bool:
        return 0 < len(rows) <= self.max_batch and all(
            -(-r.context_len // self.kv.block_size) <= self.width for r in rows)

    # ---- one step --------------------------------------------------------------------
    def run(self, rows: list[DecodeRow], phases: StepPhases | None = None):
        """(logits [n, V], greedy tokens [n]) of a decode step of n = len(rows) sequences, on
        the device; None when it must run eagerly. The argmax is part of the graph: a greedy
        step reads its tokens back without another launch."""
        if self.disabled or not self.fits(rows):
            return None
        sig = self.signature()
        if phases is not None:
            phases.mark("signature")
        if sig is None:
            return None
        bucket = pick_bucket(len(rows), self.buckets)
        self.steps_per_bucket[bucket] += 1
        self._upload(rows, bucket)
        if phases is not None:
            phases.mark("prepare")
        n = len(rows)
        if not self.capture:
            logits, tokens = self._forward(bucket)
            return logits[:n], tokens[:n]
        kept = self.graphs.setdefault(bucket, OrderedDict())
        entry = kept.get(sig)
        if entry is not None:
            kept.move_to_end(sig)
        else:
            try:
                entry = self._capture(bucket, sig)
            except RuntimeError as err:  # an operator that cannot be captured after all
                warnings.warn(f"decode graphs off: capturing a step of {bucket} failed ({err}); "
                              "steps run eagerly from now on", RuntimeWarning, stacklevel=2)
                self.disabled = True
                return None
        if self.replay_events is None:
            entry[0].replay()
        else:  # a benchmark's profile: the replay's device span, between two events
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entry[0].replay()
            end.record()
            self.replay_events.append((bucket, start, end))
        self.num_replays += 1
        logits, tokens = entry[1]
        return logits[:n], tokens[:n]

    def _upload(self, rows: list[DecodeRow], bucket: int) -> None:
        """Host values of the step into the pinned mirror, one copy into the static rows.
        The mirror is reused: the previous step's copy has finished, since the engine read
        that step's sampled tokens back (its one synchronisation) before building this one.
        Written through numpy: a torch element assignment costs microseconds of dispatch,
        and a step of 64 rows made hundreds of them."""
        bs, host = self.kv.block_size, self.host_np
        host[:bucket, _FIELDS:] = -1
        for i, r in enumerate(rows):
            pos = r.context_len - 1
            n = -(-r.context_len // bs)
            host[i, 0], host[i, 1], host[i, 3] = r.token_id, pos, r.context_len
            host[i, 2] = self.kv.token_offsets(r.block_ids, pos, pos + 1)[0]
            host[i, _FIELDS:_FIELDS + n] = r.block_ids[:n]
        if bucket > len(rows):  # padding repeats row 0 (same inputs, same KV slot, same values)
            host[len(rows):bucket] = host[0]
        self.static[:bucket].copy_(self.host[:bucket], non_blocking=True)

    def _step(self, bucket: int) -> PagedStep:
        s = self.static[:bucket]
        return PagedStep(kv=self.kv, impl="inplace", positions=s[:, 1], query_lens=[], context_lens=[],
                         new_offsets=s[:, 2], block_table=s[:, _FIELDS:], seq_context_lens=s[:, 3])

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.forward_paged(self.static[:bucket, 0], self._step(bucket), self.rows[:bucket])
        return logits, logits.argmax(dim=-1)

    def _capture(self, bucket: int, sig: tuple):
        """Warm up on a side stream (compiles kernels, creates library handles: nothing of
        that may happen during capture), then capture. The warm-up computes this very step
        and the replay that follows computes it again: the same KV values to the same slots."""
        kept = self.graphs.setdefault(bucket, OrderedDict())
        while len(kept) >= self.graphs_per_bucket:  # release before capturing: the pool reuses it
            kept.popitem(last=False)
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        self.capture_warmup_seconds += time.perf_counter() - start
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._forward(bucket)
        kept[sig] = (graph, outputs)
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - start
        return kept[sig]
