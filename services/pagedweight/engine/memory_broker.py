"""Moves bytes between the KV cache and the expert weights, for the scheduler.

The scheduler asks for KV blocks; the broker
- `reserve`s them: grows the KV cache with blocks from the arena's free bytes;
- when the pool has no bytes left, `ask`s the weight pager to lower bits
  (`request_bytes`, non-blocking: the freed planes land in the pool at a later step
  boundary; asking again while lowerings are pending plans nothing twice). While bytes
  are pending every short sequence waits; `ask` says False only when the pager can free
  nothing more, which is when the scheduler may preempt. An ask lowers once for the
  projected demand (below) rather than for this step's shortage only, so one deeper
  plan replaces a string of small ones;
- at each step boundary lets the pager commit (`step_boundary`), and once the load has
  been calm for a few steps (nobody short of KV, nobody waiting) shrinks the KV cache to
  what the running sequences need and `offer_bytes` the pool's free bytes back to the
  weights, so bits go up again when load falls; only spare bytes worth a raise are offered
  (at least `offer_min_blocks`, and a quarter of the KV in use by default: under a steady
  overload the lowered bits stay until the load has really fallen).
The projected demand is the KV blocks that the sequences in flight and those
queued that can be admitted still need to finish (prompt + max_tokens, less what they
hold), given by the scheduler at every step boundary. The cache keeps free blocks for it
when it shrinks, so only bytes that will stay free are offered: a raise for bytes the
load takes back a few steps later costs a copy now and a lowering then (churn).
Without a pager (fixed weights) the broker only grows the cache from the arena (a cache
without an arena has a fixed size) and `ask` is always False.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from pagedweight.common.errors import UserError
from pagedweight.memory.kv_cache import PagedKVCache


class WeightPager(Protocol):
    """The memory controller of the weight pages (services/worker/memory, runtime side)."""

    def request_bytes(self, num_bytes: int) -> int: ...  # bytes pending lowerings will free
    def offer_bytes(self, num_bytes: int) -> int: ...  # bytes it will take back
    def step_boundary(self, sequences_running: bool = False): ...
    def busy(self) -> bool: ...
    def wants_boundaries(self, offer_bytes: int) -> bool: ...


@dataclass(frozen=True)
class BrokerConfig:
    calm_steps: int = 16  # steps without KV shortage before bytes are given back (hysteresis)
    headroom_blocks: int = 4  # free KV blocks kept while sequences are running
    # Raise hysteresis beyond calm_steps: bytes go back to the weights only once
    # the load has also been calm for calm_seconds, and only when at least offer_min_blocks
    # KV blocks' worth of bytes are spare (a raise for crumbs is undone by the next burst:
    # it copies planes that the next lowering drops again).
    calm_seconds: float = 0.0
    offer_min_blocks: int = 0
    # ... and only when the spare bytes are at least this fraction of the KV blocks in use:
    # under a steady overload the bytes a lowering overshot by are crumbs next to the load's
    # KV and stay with it (raising them copies planes the load's next growth lowers again);
    # once the load has really fallen (a quarter of its KV would be spare) the bits come back.
    offer_min_used_fraction: float = 0.25
    # Lowering in larger steps: an ask for KV bytes also asks for this many
    # blocks beyond the shortage, so the next steps' growth finds bytes already free
    # instead of each waiting a step for its own small plan.
    ask_ahead_blocks: int = 0
    # Use the projected demand (see the module doc): ask once for it, keep it when giving back.
    project_demand: bool = True
    # ... and ask for it at a step boundary while requests are queued, before any sequence
    # is short: the lowering then lands at that boundary and the next step admits what a
    # policy without pressure would, instead of one step admitting fewer while the plan
    # lands (2g: 37 of 40 sequences at the shortage step; the prefill wave then ends a step
    # late). Off: the ask waits for the first shortage.
    ask_before_short: bool = True

    def __post_init__(self):
        if self.calm_steps < 1:
            raise UserError(f"calm_steps must be >= 1, got {self.calm_steps}")
        if self.headroom_blocks < 0:
            raise UserError(f"headroom_blocks must be >= 0, got {self.headroom_blocks}")
        if not 0 <= self.offer_min_used_fraction <= 1:
            raise UserError(f"offer_min_used_fraction must be in [0, 1], got {self.offer_min_used_fraction}")
        if self.calm_seconds < 0 or self.offer_min_blocks < 0 or self.ask_ahead_blocks < 0:
            raise UserError(f"calm_seconds, offer_min_blocks and ask_ahead_blocks must be >= 0, got "
                            f"{self.calm_seconds}, {self.offer_min_blocks} and {self.ask_ahead_blocks}")


class MemoryBroker:
    def __init__(self, kv: PagedKVCache, config: BrokerConfig, pager: WeightPager | None = None):
        self.kv, self.config, self.pager = kv, config, pager
        self.pool = kv.arena.pool if kv.arena is not None else None
        self.num_requests = 0  # request_bytes calls that had bytes to free
        self.num_offers = 0  # accepted offer_bytes calls
        self.num_offers_too_small = 0  # calm steps whose spare bytes were under offer_min_blocks
        self._short_blocks = 0  # blocks sequences were short of in this step, all asks together
        self.num_short_steps = 0  # steps in which some sequence waited for KV bytes (stalled)
        self._calm_steps = 0
        self._calm_since = time.monotonic()  # when the load last was short of KV or queued
        self._projected_blocks = 0  # blocks the admitted and admissible sequences still need
        self.num_projected_asks = 0  # of num_requests: made at a boundary for the projection (ask_before_short)

    def reserve(self, num_blocks: int) -> bool:
        """Make num_blocks free blocks exist, growing from the pool; True if they do."""
        missing = num_blocks - self.kv.num_free_blocks
        if missing > 0:
            self.kv.grow(missing)
        return self.kv.num_free_blocks >= num_blocks

    def ask(self, num_blocks: int) -> bool:
        """KV is short by num_blocks (on top of earlier asks this step); True while
        waiting for the pager can help."""
        self._short_blocks += max(num_blocks, 1)
        if self.pager is None:
            return False
        blocks = self._short_blocks + self.config.ask_ahead_blocks
        if self.config.project_demand:  # the demand still to come, beyond the free blocks
            blocks = max(blocks, self._projected_blocks - self.kv.num_free_blocks)
        needed = blocks * self.kv.charged_block_bytes
        wanted = needed - self.pool_free_bytes()
        if wanted <= 0:  # the bytes are free but scattered: ask for whole blocks' worth
            wanted = needed
        if self.pager.request_bytes(wanted) > 0:
            self.num_requests += 1
            return True
        # Nothing left to lower. Free KV tiles lying among the weights may be all that keeps
        # the arena's free pages apart: give them back, so the pager's compaction can join
        # them with the holes beside them into runs the cache then grows from.
        if self.kv.arena is not None and self.kv.num_free_blocks and self.kv.shrink(keep_free_blocks=0):
            if self.pager.request_bytes(wanted) > 0:
                self.num_requests += 1
                return True
        return False

    def moving(self) -> bool:
        """Whether the pager has copies in flight (they may still change what is free)."""
        return self.pager is not None and self.pager.busy()

    def step_boundary(self, num_waiting: int, blocks_needed_next: int, blocks_projected: int = 0) -> None:
        """blocks_projected: KV blocks the running and admissible queued sequences still
        need to finish (Scheduler.blocks_projected); 0 when unknown."""
        self._projected_blocks = blocks_projected if self.config.project_demand else 0
        if self.pager is not None and num_waiting and self.config.project_demand and self.config.ask_before_short:
            self._ask_for_projection()
        if self.pager is not None:
            self.pager.step_boundary(sequences_running=self.kv.manager.num_used_blocks > 0)
        self.num_short_steps += bool(self._short_blocks)
        pressed = bool(self._short_blocks or num_waiting)
        self._calm_steps = 0 if pressed else self._calm_steps + 1
        now = time.monotonic()
        if pressed:
            self._calm_since = now
        self._short_blocks = 0
        if self._calm_steps >= self.config.calm_steps and now - self._calm_since >= self.config.calm_seconds:
            self._give_back(blocks_needed_next)

    def _ask_for_projection(self) -> None:
        """Lower now for the projected demand that the free blocks and the pool's free bytes
        cannot hold (nothing when they can, fragmentation aside: `reserve` grows then)."""
        missing = self._projected_blocks - self.kv.num_free_blocks
        if missing <= 0:
            return
        wanted = missing * self.kv.charged_block_bytes - self.pool_free_bytes()
        if wanted > 0 and self.pager.request_bytes(wanted) > 0:
            self.num_requests += 1  # a request_bytes call with bytes to free, as ask's
            self.num_projected_asks += 1

    def _give_back(self, blocks_needed_next: int) -> None:
        if self.kv.arena is None:
            return  # a fixed-size cache keeps its blocks
        # Blocks the load in flight will still take stay in the cache: their bytes are not spare.
        keep = max(blocks_needed_next, self._projected_blocks)
        if self.kv.manager.num_used_blocks:  # sequences running: keep some headroom
            keep += self.config.headroom_blocks
        self.kv.shrink(keep_free_blocks=keep)
        if self.pager is None:
            return
        # The pager refuses at once (O(1)) an offer of no more free bytes than it last found
        # no use for, so calm steps do not re-plan the same nothing.
        spare = self.pool_free_bytes()
        if spare < self._min_offer_bytes():
            self.num_offers_too_small += 1
            return  # too little to be worth copying planes for
        if self.pager.offer_bytes(spare) > 0:
            self.num_offers += 1

    def wants_idle_steps(self) -> bool:
        """Whether steps without requests still have work: KV blocks to shrink, or the
        pager moving bits or able to take the spare bytes. The worker's idle ticks run
        while this holds, so bits come back after a load ends (engine/async_engine.py)."""
        if self.pager is None:
            return False
        if self.kv.arena is not None and self.kv.num_free_blocks > 0:
            return True
        spare = self.pool_free_bytes()
        offerable = spare >= max(self._min_offer_bytes(), 1)
        return self.pager.wants_boundaries(spare if offerable else -1)

    def _min_offer_bytes(self) -> int:
        """Spare bytes below this are too little to be worth copying planes for: the larger of
        offer_min_blocks and offer_min_used_fraction of the blocks in use."""
        used = self.kv.manager.num_used_blocks
        blocks = max(self.config.offer_min_blocks, math.ceil(self.config.offer_min_used_fraction * used))
        return blocks * self.kv.charged_block_bytes

    def pool_free_bytes(self) -> int:
        if self.pool is None:
            return 0
        return self.pool.free_bytes
