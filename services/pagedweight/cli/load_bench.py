"""A closed-loop load on one worker runtime: what `pagedweight bench engine` measures.

`concurrency` requests are kept in flight (a new one is added as soon as one finishes)
until `num_requests` have been sent; every request has a random prompt of `prompt_len`
tokens and generates exactly `max_tokens` (EOS ignored). After the load the engine keeps
stepping idle until the pager has nothing left to do, so the weights can take their
bytes back: `bits_mean_end` is measured then. Mean bits are per expert weight (blocks
weighted by their size), over the committed bits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedweight.engine.sampler import SamplingParams
from pagedweight.runtime import WorkerRuntime


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 64
    concurrency: int = 16
    prompt_len: int = 64
    max_tokens: int = 64
    seed: int = 0
    max_drain_steps: int = 500  # idle steps allowed for the weights to take bytes back


def mean_committed_bits(runtime: WorkerRuntime) -> float:
    entries = runtime.table.entries.values()
    num_weights = sum(e.num_weights for e in entries)
    return sum(e.committed_bits * e.num_weights for e in entries) / max(num_weights, 1)


@dataclass
class LoadResult:
    completed: int  # requests finished with "length" (EOS is ignored)
    failed: int  # requests that finished any other way
    output_tokens: int
    elapsed_s: float


def drive_load(engine, spec: LoadSpec, after_step=lambda: None) -> LoadResult:
    """Keep `concurrency` random requests in flight until `num_requests` have finished."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(spec.seed)
    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    sent = completed = failed = output_tokens = 0
    in_flight: set[str] = set()
    start = time.perf_counter()
    while sent < spec.num_requests or in_flight:
        while sent < spec.num_requests and len(in_flight) < spec.concurrency:
            prompt = torch.randint(1, vocab, (spec.prompt_len,), generator=gen).tolist()
            engine.add_request(f"r{sent}", prompt, params)
            in_flight.add(f"r{sent}")
            sent += 1
        for out in engine.step():
            output_tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
                if out.finish_reason == "length":
                    completed += 1
                else:
                    failed += 1
        after_step()
    return LoadResult(completed, failed, output_tokens, time.perf_counter() - start)


def run_load(runtime: WorkerRuntime, spec: LoadSpec, on_step=lambda: None) -> dict:
    """`on_step` is called after every engine step, of the load and of the drain after it
    (`bench engine --plot` samples the memory split there)."""
    engine = runtime.engine
    bits_start = mean_committed_bits(runtime)
    bits_min = [bits_start]
    moves0, plans0 = _pager_counts(runtime)  # start-up loading is not part of the load
    short0 = engine.broker.num_short_steps
    if runtime.pager is not None:
        runtime.pager.mover.profile.reset()
        runtime.table.num_descriptor_updates, runtime.table.descriptor_seconds = 0, 0.0

    def track_bits():
        bits_min[0] = min(bits_min[0], mean_committed_bits(runtime))
        on_step()

    load = drive_load(engine, spec, track_bits)
    drain_steps = _drain(runtime, spec.max_drain_steps, on_step)
    pool = runtime.pool.snapshot()
    stats = engine.stats()
    pager = runtime.pager.stats() if runtime.pager is not None else None
    moves, plans = _pager_counts(runtime)
    return {
        "requests_completed": load.completed,
        "requests_failed": load.failed,
        "output_tokens": load.output_tokens,
        "elapsed_s": round(load.elapsed_s, 3),
        "output_tokens_per_s": round(load.output_tokens / load.elapsed_s, 2),
        "preemptions": stats.num_preemptions,
        "peak_pool_bytes": pool.peak_in_use_bytes,
        "peak_reserved_bytes": pool.peak_reserved_bytes,
        "budget_bytes": pool.budget_bytes,
        "page_moves": moves - moves0,
        "plans": plans - plans0,
        "memory_requests": stats.memory_requests,
        "memory_offers": stats.memory_offers,
        "steps": stats.num_steps,
        "drain_steps": drain_steps,
        "bits_mean_start": round(bits_start, 4),
        "bits_mean_min": round(bits_min[0], 4),
        "bits_mean_end": round(mean_committed_bits(runtime), 4),
        "bits_histogram_end": pager.to_dict()["bits_histogram"] if pager else None,
        "memory_short_steps": stats.memory_short_steps - short0,
        "pager_profile": pager.profile if pager else None,
    }


def _pager_counts(runtime: WorkerRuntime) -> tuple[int, int]:
    """(committed bit changes, plans asked of the planner) so far."""
    if runtime.pager is None:
        return 0, 0
    stats = runtime.pager.stats()
    return stats.num_page_moves, stats.num_plans


def _drain(runtime: WorkerRuntime, max_steps: int, on_step=lambda: None) -> int:
    """Step idle until the pager is done moving pages and has been offered the bytes."""
    calm = runtime.engine.config.broker.calm_steps
    quiet = 0
    for step in range(max_steps):
        before = mean_committed_bits(runtime)
        runtime.engine.step()
        on_step()
        busy = runtime.pager is not None and runtime.pager.busy()
        quiet = 0 if (busy or mean_committed_bits(runtime) != before) else quiet + 1
        if busy:
            time.sleep(0.001)  # copies land on the mover's thread; do not spin against it
        if quiet > calm + 1:
            return step + 1
    return max_steps
