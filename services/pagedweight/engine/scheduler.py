"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens.

Each step has a token budget (`max_num_batched_tokens`) shared by decodes and prefills,
and at most `max_num_seqs` sequences hold KV blocks. Long prompts are prefilled in
chunks across steps. Algorithm of `schedule()`:
1. RUNNING sequences first, oldest first: each gets its uncomputed tokens (1 for a
   decode) within the budget, and the KV blocks to hold them. When blocks are short the
   memory broker grows the KV cache from the pool or asks the weight pager for bytes;
   while the pager can still free bytes the sequence waits a step. Only when no more
   bytes can come does the youngest running sequence lose its KV (preemption by
   recompute: it goes back to the front of WAITING, its tokens are kept).
2. Then WAITING sequences, first come first served, while the budget lasts: a sequence is
   admitted only when the blocks for all its known tokens are available; otherwise the
   broker is asked for bytes and admission stops (no overtaking, so nobody starves).
Nothing is ever dropped: a sequence leaves only by finishing or by abort. The one
exception keeps the engine live: a queued sequence whose blocks cannot be had while
nothing runs and the pager can neither lower, compact nor finish a move would wait for
ever; it finishes unrun with reason "length", as vLLM ignores a prompt that exceeds its
KV capacity.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from pagedweight.common.errors import UserError
from pagedweight.engine.sequence import FinishReason, Sequence, SequenceStatus
from pagedweight.memory.kv_cache import PagedKVCache, blocks_for


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences holding KV blocks at once
    max_num_batched_tokens: int = 512  # new tokens per step, prefill and decode together

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise UserError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise UserError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed in this step

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token (so it samples)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in batch order
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this step
    num_waiting_for_memory: int = 0  # sequences that wait for bytes from the pager
    ignored: list[Sequence] = field(default_factory=list)  # finished unrun: they can never get their KV

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: PagedKVCache, broker):
        self.config = config
        self.kv = kv
        self.broker = broker  # MemoryBroker: reserve / ask for KV blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # First, the RUNNING sequences (oldest first).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            outcome = self._make_room(seq, seq.num_computed_tokens + n, out)
            if outcome == "scheduled":
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
            elif outcome == "wait":
                out.num_waiting_for_memory += 1
            if outcome != "preempted_self":
                i += 1
        # Next, the WAITING sequences, first come first served.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.num_waiting_for_memory or out.preempted:
                break  # running sequences are short of KV: admit nobody new
            seq = self.waiting[0]
            needed = self.kv.num_missing_blocks(seq, seq.num_tokens)
            if not self.broker.reserve(needed):
                if not self.broker.ask(needed - self.kv.num_free_blocks) and not self.running \
                        and not self.broker.moving():
                    # Nothing runs to free blocks and no bytes can come: it would wait for ever.
                    self.finish(seq, FinishReason.LENGTH)
                    out.ignored.append(seq)
                    continue
                out.num_waiting_for_memory += 1
                break
            n = min(seq.num_uncomputed_tokens, budget)
            self.kv.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> str:
        """Give seq blocks for num_tokens tokens: 'scheduled', 'wait' or 'preempted_self'."""
        while True:
            needed = self.kv.num_missing_blocks(seq, num_tokens)
            if self.broker.reserve(needed):
                self.kv.allocate(seq, num_tokens)
                return "scheduled"
            if self.broker.ask(needed - self.kv.num_free_blocks):
                return "wait"  # the pager is freeing bytes; try again next step
            victim = self.running[-1]  # last resort: the youngest loses its KV
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return "preempted_self"

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def blocks_needed_next_step(self) -> int:
        """Blocks the running sequences need for their next token (a shrink keeps these)."""
        bs = self.kv.block_size
        return sum(
            max(0, blocks_for(s.num_tokens + 1, bs) - len(s.block_ids)) for s in self.running
        )

    def blocks_projected(self) -> int:
        """KV blocks the running sequences, and the queued ones that free slots admit, still
        need to finish: prompt + max_tokens, less the blocks they hold. The memory broker
        lowers once for this and offers only bytes beyond it (memory_broker.py)."""
        bs = self.kv.block_size
        admissible = itertools.islice(self.waiting, max(0, self.config.max_num_seqs - len(self.running)))
        return sum(max(0, blocks_for(s.max_total_tokens, bs) - len(s.block_ids))
                   for s in itertools.chain(self.running, admissible))
