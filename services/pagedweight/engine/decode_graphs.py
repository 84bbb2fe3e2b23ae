"""CUDA-graph replay of engine steps as token rows, per padded bucket.

At real sizes a decode step is bound by the host issuing ~1,500 small operators, not by
the GPU (docs/real_shape.md). A decode step's work has a fixed shape once its batch is
padded to a bucket, so it is captured once per bucket and replayed: one launch instead of
thousands.

Steps with prefill chunks replay the same graphs (`StepChunk`):
every new token is one row, with its own position, KV slot, context length (its position
+ 1) and its sequence's block table. The in-place attention writes every row's k, v
before it attends, and each row attends up to its own length, so a chunk's rows attend
causally to each other and to the context before them: the step computes what the
eager varlen step computes (the attention through the decode kernel instead of SDPA over
a gathered copy: equal up to rounding). Decode buckets (up to the engine's max_num_seqs)
and token buckets above them (up to `max_tokens`) are one list; a step of T rows takes
the smallest bucket holding T. Logits are computed only for the rows that sample (a
static row index, at most max_batch of them), so a token bucket's graph computes
[max_batch, V] logits, not [T, V], into the one buffer every graph writes (`logits_out`).

What makes a replay valid for any step of its bucket:
- Inputs live in static device buffers. Each step's host values (token ids, positions,
  KV slot offsets, context lengths, block tables padded to the model's longest context)
  go into one pinned host mirror and cross in one non-blocking copy into the rows the
  bucket reads. Padding rows repeat row 0: they compute what row 0 computes and write the
  same KV values to the same slot, so they disturb nothing and need no scratch block.
  They route as row 0 does, though: the routing observers are handed the static column
  that marks the step's own rows (`set_row_weights`), so the planner's routing statistics
  count each token once, however large the bucket's padding (prefill buckets go to 512).
- Attention is the `inplace` path (model/paged_attention.py): it reads the cache through
  tile offsets computed on the device from the block-table buffer, and the Triton kernel
  loops to each sequence's own length. Not all work stops there: the tile offsets, the
  host upload and the torch decode path (layers narrower than the cache's slot, such as
  Gemma-4's full-attention layers) scale with the table's width, and at the model's whole
  context (Gemma-4: 262,144 positions, 16,384 blocks) that made every replayed step read
  and mask 16,384 blocks per sequence. So a graph is captured per (row bucket, table
  width class): the table's columns come in classes growing 4x from 16 blocks to the
  model's context (`table_widths`), and a step takes the smallest class holding its
  longest sequence. A decode run crosses a class only when its longest context does (a
  few times over a whole context), and each crossing captures once.
- The experts operators say what their launches depend on through `graph_state(dtype)`: it
  brings device-side state up to date in place (the fused kernel's descriptor rows after
  the pager moved pages) and returns the host-side choices a capture bakes in (bit
  classes, widest bits). A bucket is captured again when that signature changes, and an
  operator that returns None (or has no such method) keeps the step eager. The routing
  observer's identity is part of the signature: its device-side counters are captured.
- Steps with more rows than the largest bucket run eagerly; with `max_tokens` None (the
  engine's `graph_prefill` off) so do steps with a prefill chunk (the runner decides).

`capture=False` runs the same static-buffer plumbing without capturing (the CPU tests
check padding and buffers against the eager engine that way); its counters count what a
capturing run would do (`num_captures`: a (bucket, width, signature) met for the first
time or after its graph was dropped; `num_replays`: a step that a kept graph would serve),
so the CPU tests can hold a steady decode run to no capture.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagedweight.engine.step_phases import StepPhases
from pagedweight.memory.kv_cache import PagedKVCache
from pagedweight.model.paged_attention import PagedStep
from pagedweight.model.transformer import MoECausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# per row: input id, position, new KV offset, context length, the logits row (row j of the
# graph's logits is token row static[j, 4]: only the first min(bucket, max_batch) are read),
# 1 for a row of the step and 0 for a padding row (what the routing observers count), the
# row's offset into the prompt routing counts (steps with prompt rows); then the block table
TABLE_COLUMN = 7
LOGITS_ROW = 4
REAL_ROW = 5
PROMPT_ROW = 6
FIRST_TABLE_WIDTH = 16  # blocks: 256 tokens at the engine's default block size
TABLE_WIDTH_GROWTH = 4


def buckets_up_to(max_batch: int, buckets=DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a batch of at most max_batch sequences can use (max_batch itself last)."""
    chosen = tuple(b for b in buckets if b < max_batch)
    return chosen + (max_batch,)


def token_buckets(max_batch: int, max_tokens: int | None, buckets=DEFAULT_BUCKETS) -> tuple[int, ...]:
    """Buckets above the decode buckets for steps of up to max_tokens token rows (prefill
    chunks); () when max_tokens is None or not above max_batch."""
    if max_tokens is None or max_tokens <= max_batch:
        return ()
    return tuple(b for b in buckets if max_batch < b < max_tokens) + (max_tokens,)


def table_widths(max_width: int, first: int = FIRST_TABLE_WIDTH, growth: int = TABLE_WIDTH_GROWTH) -> tuple[int, ...]:
    """Block-table width classes up to max_width (the model's context in blocks, last)."""
    widths, w = [], first
    while w < max_width:
        widths.append(w)
        w *= growth
    return tuple(widths) + (max_width,)


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n sequences; None when n exceeds them all."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class StepChunk:
    """One sequence's part of a step, as the host knows it: its new tokens (one for a
    decode, a prefill chunk's several) ending at context_len."""

    token_ids: Sequence[int]  # the input tokens, positions context_len - n .. context_len - 1
    block_ids: list[int]  # its block table (RELEASED entries stay negative)
    context_len: int  # tokens in the cache after this step
    samples: bool = True  # its last row's logits are wanted


class DecodeGraphs:
    def __init__(self, model: MoECausalLM, kv: PagedKVCache, max_batch: int,
                 buckets: tuple[int, ...] | None = None, capture: bool | None = None,
                 graphs_per_bucket: int = 1, max_tokens: int | None = None):
        if graphs_per_bucket < 1:
            raise ValueError(f"graphs_per_bucket must be >= 1, got {graphs_per_bucket}")
        self.model, self.kv = model, kv
        # the MoE blocks, once: the graphs capture these modules, and the model's property
        # rebuilds the list through nn.Module lookups (~0.8 us a layer), asked twice a step
        self.blocks = model.moe_blocks
        # Graphs kept per bucket, one per signature, least recently used dropped first: a pager
        # that lowers bits under pressure and raises them back returns to signatures it has
        # captured before, and replaying a kept graph costs nothing where a capture costs a
        # warm-up step and the capture itself.
        self.graphs_per_bucket = graphs_per_bucket
        self.buckets = buckets_up_to(max_batch) if buckets is None else tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]  # the most sequences (logits rows) a step has
        # steps of more rows than sequences (prefill chunks): buckets up to max_tokens rows
        self.token_buckets = token_buckets(self.max_batch, max_tokens)
        self.row_buckets = self.buckets + self.token_buckets
        self.max_rows = self.row_buckets[-1]
        self.capture = kv.device.type == "cuda" if capture is None else capture
        self.width = -(-model.config.max_position_embeddings // kv.block_size)  # table columns at most
        self.table_widths = table_widths(self.width)
        # One flat buffer; a step of `bucket` rows and table width w reads its first
        # bucket * (TABLE_COLUMN + w) elements as rows of TABLE_COLUMN + w (`rows`): one
        # contiguous copy per step, as long as the step's table is wide.
        size = self.max_rows * (TABLE_COLUMN + self.width)
        self.static = torch.zeros(size, dtype=torch.int64, device=kv.device)
        pin = kv.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()  # the same memory: rows are filled without torch dispatch
        # Every graph writes its logits into this one buffer (rows = the step's sampling
        # rows): a graph's own logits output would stay allocated in the pool for as long as
        # the graph is kept, [rows, V] per bucket and signature (at Qwen1.5-MoE's vocabulary
        # and 64 sequences, 15 buckets: about 177 MB against this buffer's 19 MB). One step
        # runs at a time and its logits are read before the next replay.
        self.logits_out = torch.empty(self.max_batch, model.lm_head.weight.shape[0], dtype=model.dtype, device=kv.device)
        # (bucket, table width) -> {sig: (graph, (logits, greedy tokens))}, most recently used
        # last (without capture: sig -> None)
        self.graphs: dict[tuple[int, int], OrderedDict[tuple, tuple | None]] = {}
        self.pool = None
        self.num_captures = self.num_replays = 0
        self.steps_per_bucket: Counter = Counter()  # bucket -> steps it served
        self.steps_per_width: Counter = Counter()  # table width -> steps it served
        self.prefill_steps = 0  # steps served that had a chunk of more than one token
        self.padding_rows = 0  # rows computed only to fill a bucket, over all steps served
        self.capture_seconds = 0.0  # host time in captures, warm-up included (a step waits for it)
        self.capture_warmup_seconds = 0.0  # of which the eager warm-up step before each capture
        self.disabled = False  # a capture failed: every step eager
        self.prefill_disabled = False  # a capture of a step with a prefill chunk failed: those eager
        self.replay_events: list | None = None  # a list: (bucket, start, end) CUDA events per replay

    # ---- when a step can replay ------------------------------------------------------
    def signature(self) -> tuple | None:
        """What captured graphs depend on beyond the buffers; None: not capturable now."""
        parts = []
        for block in self.blocks:
            state = getattr(block.experts, "graph_state", None)
            state = state(self.model.dtype) if state is not None else None
            if state is None:
                return None
            parts.append((id(block.observer), state))
        return tuple(parts)

    def fits(self, chunks: list[StepChunk], rows: int) -> bool:
        """rows: the chunks' tokens (the caller has counted them)."""
        return (0 < rows <= self.max_rows and sum(c.samples for c in chunks) <= self.max_batch
                and all(-(-c.context_len // self.kv.block_size) <= self.width for c in chunks))

    def logits_rows(self, bucket: int) -> int:
        """Rows of logits a bucket's graph computes (every sampling sequence's last row)."""
        return min(bucket, self.max_batch)

    # ---- one step --------------------------------------------------------------------
    def run(self, chunks: list[StepChunk], phases: StepPhases | None = None):
        """(logits [n, V], greedy tokens [n]) of a step whose sequences' new tokens are
        `chunks` (n = the chunks that sample, in order), on the device; None when it must
        run eagerly. The argmax is part of the graph: a greedy step reads its tokens back
        without another launch."""
        rows = sum(len(c.token_ids) for c in chunks)
        if self.disabled or not self.fits(chunks, rows):
            return None
        prefill = rows > len(chunks)
        if prefill and self.prefill_disabled:
            return None
        sig = self.signature()
        prompt_rows = self._prompt_rows()
        if phases is not None:
            phases.mark("signature")
        if sig is None or prompt_rows is False:
            return None
        sig += (prompt_rows is not None,)  # the last part: this graph records prompt routing
        bucket = pick_bucket(rows, self.row_buckets)
        width = self.table_width(chunks)
        self.steps_per_bucket[bucket] += 1
        self.steps_per_width[width] += 1
        self.prefill_steps += prefill
        n = self._upload(chunks, bucket, width, prompt_rows)
        if phases is not None:
            phases.mark("prepare")
        kept = self.graphs.setdefault((bucket, width), OrderedDict())
        if not self.capture:  # count what a capturing run would do, then run the step
            if sig in kept:
                kept.move_to_end(sig)
                self.num_replays += 1
            else:
                self._make_room(kept, sig)
                kept[sig] = None
                self.num_captures += 1
            logits, tokens = self._forward(bucket, width, sig[-1])
            return logits[:n], tokens[:n]
        entry = kept.get(sig)
        if entry is not None:
            kept.move_to_end(sig)
        else:
            try:
                entry = self._capture(bucket, width, sig)
            except RuntimeError as err:  # an operator that cannot be captured after all
                what = "steps with a prefill chunk" if prefill else "steps"
                warnings.warn(f"decode graphs off: capturing a step of {bucket} rows failed ({err}); "
                              f"{what} run eagerly from now on", RuntimeWarning, stacklevel=2)
                if prefill:  # the decode buckets' graphs still serve decode steps
                    self.prefill_disabled = True
                else:
                    self.disabled = True
                return None
        if self.replay_events is None:
            entry[0].replay()
        else:  # a benchmark's profile: the replay's device span, between two events
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entry[0].replay()
            end.record()
            self.replay_events.append(((bucket, width), start, end))
        self.num_replays += 1
        logits, tokens = entry[1]
        return logits[:n], tokens[:n]

    def table_width(self, chunks: list[StepChunk]) -> int:
        """The smallest width class holding every chunk's table (the caller checked `fits`)."""
        blocks = max(-(-c.context_len // self.kv.block_size) for c in chunks)
        return pick_bucket(blocks, self.table_widths)

    def rows(self, bucket: int, width: int, host: bool = False):
        """The buffer's first `bucket` rows as a step of table width `width` reads them:
        [bucket, TABLE_COLUMN + width] (host: the pinned mirror, as numpy)."""
        flat = self.host_np if host else self.static
        return flat[:bucket * (TABLE_COLUMN + width)].reshape(bucket, TABLE_COLUMN + width)

    def _prompt_rows(self):
        """The prompt routing recorder's row offsets for this step (PromptRoutingRecorder.
        graph_rows): None where there is none or the step has no prompt rows, False where the
        step must run eagerly."""
        for observer in self._row_weighted_observers():
            if hasattr(observer, "graph_rows"):
                return observer.graph_rows()
        return None

    def _upload(self, chunks: list[StepChunk], bucket: int, width: int, prompt_rows=None) -> int:
        """Host values of the step into the pinned mirror, one copy into the static rows;
        returns the number of sampling chunks. The mirror is reused: the previous step's
        copy has finished, since the engine read that step's sampled tokens back (its one
        synchronisation) before building this one. Written through numpy, a chunk's rows as
        slices: a torch element assignment costs microseconds of dispatch, and a step of 64
        rows made hundreds of them."""
        bs, host = self.kv.block_size, self.rows(bucket, width, host=True)
        host[:, TABLE_COLUMN:] = -1
        i, samplers = 0, []
        for c in chunks:
            n, end = len(c.token_ids), c.context_len
            start = end - n
            rows = slice(i, i + n)
            host[rows, 0] = c.token_ids
            host[rows, 1] = np.arange(start, end)
            host[rows, 2] = self.kv.token_offsets(c.block_ids, start, end)
            host[rows, 3] = host[rows, 1] + 1
            # every row of a chunk reads its sequence's table up to the chunk's end; the
            # kernel stops at each row's own length
            table = c.block_ids[:-(-end // bs)]
            host[rows, TABLE_COLUMN:TABLE_COLUMN + len(table)] = table if n == 1 else np.asarray(table)  # one conversion
            i += n
            if c.samples:
                samplers.append(i - 1)
        host[:i, REAL_ROW] = 1
        if prompt_rows is not None:
            host[:i, PROMPT_ROW] = prompt_rows
        if bucket > i:  # padding repeats row 0 (same inputs, same KV slot, same values)
            host[i:bucket] = host[0]
            host[i:bucket, REAL_ROW] = 0
            self.padding_rows += bucket - i
        wanted = self.logits_rows(bucket)  # the rest repeat the first: computed, not read
        host[:wanted, LOGITS_ROW] = samplers + [samplers[0] if samplers else 0] * (wanted - len(samplers))
        size = bucket * (TABLE_COLUMN + width)
        self.static[:size].copy_(self.host[:size], non_blocking=True)
        return len(samplers)

    def _step(self, bucket: int, width: int) -> PagedStep:
        s = self.rows(bucket, width)
        return PagedStep(kv=self.kv, impl="inplace", positions=s[:, 1], query_lens=[], context_lens=[],
                         new_offsets=s[:, 2], block_table=s[:, TABLE_COLUMN:], seq_context_lens=s[:, 3])

    def _forward(self, bucket: int, width: int, records_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        static = self.rows(bucket, width)
        rows = static[:self.logits_rows(bucket), LOGITS_ROW]
        observers = self._row_weighted_observers()
        for observer in observers:  # views of the static buffer: a capture reads them at replay too
            observer.set_row_weights(static[:, REAL_ROW])
            if hasattr(observer, "set_graph_rows"):
                observer.set_graph_rows(static[:, PROMPT_ROW] if records_prompts else None)
        try:
            logits = self.model.forward_paged(static[:, 0], self._step(bucket, width), rows)
        finally:  # eager steps have no padding rows
            for observer in observers:
                observer.set_row_weights(None)
                if hasattr(observer, "set_graph_rows"):
                    observer.set_graph_rows(None)
        if logits.dtype != self.logits_out.dtype:
            raise RuntimeError(f"decode graphs: logits in {logits.dtype}, the shared buffer is {self.logits_out.dtype}")
        out = self.logits_out[:logits.shape[0]]
        out.copy_(logits)
        return out, out.argmax(dim=-1)

    def _row_weighted_observers(self) -> list:
        """The MoE blocks' routing observers that take row weights, each once."""
        found = {}
        for block in self.blocks:
            observer = block.observer
            if observer is not None and hasattr(observer, "set_row_weights"):
                found.setdefault(id(observer), observer)
        return list(found.values())

    def _make_room(self, kept: OrderedDict, sig: tuple) -> None:
        """Drop graphs before capturing another (the pool reuses their memory), least
        recently used first, among the graphs of the same kind: a bucket keeps
        graphs_per_bucket with and without the prompt recording, so prefills and decodes at
        one bucket do not evict each other."""
        same_kind = [s for s in kept if s[-1] == sig[-1]]
        while len(same_kind) >= self.graphs_per_bucket:
            del kept[same_kind.pop(0)]

    def _capture(self, bucket: int, width: int, sig: tuple):
        """Warm up on a side stream (compiles kernels, creates library handles: nothing of
        that may happen during capture), then capture. The warm-up computes this very step
        and the replay that follows computes it again: the same KV values to the same slots."""
        kept = self.graphs.setdefault((bucket, width), OrderedDict())
        self._make_room(kept, sig)
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            self._forward(bucket, width, sig[-1])
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        self.capture_warmup_seconds += time.perf_counter() - start
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._forward(bucket, width, sig[-1])
        kept[sig] = (graph, outputs)
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - start
        return kept[sig]
