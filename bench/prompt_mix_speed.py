"""What online prompt residuals cost the worker, at Qwen1.5-MoE-A2.7B's shape, on this CPU.

Two costs, each beside its baseline in the same run:
- per step (engine/prompt_routing.py's recorder on every MoE layer): a prefill-heavy step
  (PREFILLS prompts of CHUNK tokens beside DECODES decodes) and a decode-only step, against
  the `RoutingFeed` that already observes every step (the baseline);
- per plan request: the mix of the requests in flight and the heads on it (an [N, L*E]
  matrix-vector product), against the planner's own online tick on the same table
  (planner/synthetic.py's table; the tick is what every request costs anyway).

    OPENBLAS_NUM_THREADS=1 python -m bench.prompt_mix_speed [--repeats 50]

(numpy's BLAS threads: on a shared, loaded CPU its default of one thread per core makes
the heads' matrix-vector product ~10x slower than one thread; the variable is recorded.)

Writes bench/results/prompt_mix_speed.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from bench.bench_meta import write_result
from pagedweight.engine.prompt_routing import PromptRoutingRecorder
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import ScheduledSeq
from pagedweight.engine.sequence import Sequence
from pagedweight.planner.planner import OnlinePlanner
from pagedweight.planner.policies import PagedWeightPolicy, PlanContext
from pagedweight.planner.prompt_context import HeadsInBlockOrder
from pagedweight.planner.residual_predictor import ResidualPredictor
from pagedweight.planner.synthetic import QWEN15_MOE_A27B, synthetic_table
from pagedweight.weights.routing_feed import RoutingFeed

L, E, HIDDEN, _, K = QWEN15_MOE_A27B
NUM_BLOCKS = L * E * 2


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * float(np.median(times))


def step_of(prefills: int, chunk: int, decodes: int, rng) -> list[ScheduledSeq]:
    scheduled = []
    for i in range(prefills):
        seq = Sequence(i, str(i), rng.integers(0, 1000, 4 * chunk).tolist(), SamplingParams(max_tokens=64))
        seq.num_computed_tokens = chunk  # the second chunk of its prompt
        scheduled.append(ScheduledSeq(seq, chunk))
    for i in range(prefills, prefills + decodes):
        seq = Sequence(i, str(i), [1] * 32, SamplingParams(max_tokens=64))
        seq.output_ids, seq.num_computed_tokens = [2] * 5, 36
        scheduled.append(ScheduledSeq(seq, 1))
    return scheduled


def observer_costs(args, rng) -> dict:
    """One step's observer work over L layers: feed alone vs feed + recorder."""
    out = {}
    for name, prefills, decodes in (("prefill_step", args.prefills, args.decodes), ("decode_step", 0, args.decodes)):
        scheduled = step_of(prefills, args.chunk, decodes, rng)
        rows = sum(s.num_new_tokens for s in scheduled)
        x = torch.zeros(rows, HIDDEN)
        ids = torch.from_numpy(rng.integers(0, E, (rows, K)))
        weights = torch.rand(rows, K)
        feed = RoutingFeed(L, E)
        recorder = PromptRoutingRecorder(L, E)
        recorder._next = {layer: feed for layer in range(L)}  # chained after the feed, as installed

        def feed_only():
            for layer in range(L):
                feed(layer, x, ids, weights)

        def with_recorder():
            for s in scheduled:
                s.seq.num_prompt_tokens_routed, s.seq.prompt_counts = 0, None
            recorder.begin_step(scheduled)
            for layer in range(L):
                recorder(layer, x, ids, weights)
            recorder.end_step()

        out[name] = {"rows": rows, "prompt_rows": prefills * args.chunk,
                     "feed_ms": median_ms(feed_only, args.repeats),
                     "feed_and_recorder_ms": median_ms(with_recorder, args.repeats)}
    return out


def request_costs(args, rng) -> dict:
    """Per plan request: mix + heads, against the planner's online tick on the same table."""
    table = synthetic_table(*QWEN15_MOE_A27B)
    heads = ResidualPredictor(rng.normal(0, 0.01, (NUM_BLOCKS, L * E)), np.zeros(NUM_BLOCKS),
                              np.full(L * E, 1.0 / E), np.full(L * E, 0.02))
    keys = [b.key() for b in table.block_ids]
    in_order = HeadsInBlockOrder(heads, keys, keys[::-1])
    recorder = PromptRoutingRecorder(L, E)
    for i in range(args.in_flight):
        seq = Sequence(i, str(i), [1] * 256, SamplingParams(max_tokens=128))
        seq.prompt_counts, seq.num_computed_tokens = rng.integers(0, 50, (L, E)).astype(np.float64), 256 + i % 64
        recorder._in_flight[i] = seq
    policy = PagedWeightPolicy(table)
    bits = policy.plan(table.uniform_bytes(5), PlanContext()).bits
    free = int(0.05 * table.bytes_of(bits))

    def tick():
        online = OnlinePlanner(table, policy.model, bits)
        online.plan(table.bytes_of(bits) - free, policy.inputs(PlanContext()))

    return {"blocks": NUM_BLOCKS, "features": L * E, "in_flight": args.in_flight,
            "mix_and_heads_ms": median_ms(lambda: recorder.mix(in_order), args.repeats),
            "planner_tick_ms": median_ms(tick, args.repeats)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--prefills", type=int, default=8, help="prompts prefilled in the prefill step")
    ap.add_argument("--chunk", type=int, default=56, help="prompt tokens of each in that step")
    ap.add_argument("--decodes", type=int, default=64, help="decodes in each step")
    ap.add_argument("--in-flight", type=int, default=256, help="requests with prompts in flight")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if min(args.repeats, args.prefills, args.chunk, args.decodes, args.in_flight) < 1:
        ap.error("every count must be >= 1")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("timing the observers ...", file=sys.stderr, flush=True)
    steps = observer_costs(args, rng)
    print("timing a plan request ...", file=sys.stderr, flush=True)
    request = request_costs(args, rng)
    payload = {"shape": "Qwen1.5-MoE-A2.7B (24 layers x 60 experts, top-4)", "config": vars(args),
               "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
               "per_step": steps, "per_plan_request": request}
    path = write_result("prompt_mix_speed", payload)
    print(steps, request, sep="\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
