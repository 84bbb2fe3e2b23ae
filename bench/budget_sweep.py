"""The comparison at a sweep of memory budgets: bf16 in the same memory, every static width, the
fitting uniform width and the elastic policy, one run each per budget, throughput beside quality.
docs/elasticity.md says what the rows, budgets and traces are.

The budgets run from bf16 barely fitting the trace's whole KV down to only 3 bits fitting, so
every row is measured where it fits and where it does not; a row is `refused` where one
request's KV does not fit. `--kl` scores the KL_PLANS plans a row served most on held-out text.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.bench_meta import arg_parser, free_memory, log, write_result
from bench.quality_budget import Scorer, windows_of
from pagedweight.cli.load_bench import LoadSpec, drive_load, mean_committed_bits
from pagedweight.common.errors import UserError
from pagedweight.common.paths import corpus_dir
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.graph_warmup import warm_decode_buckets
from pagedweight.engine.memory_broker import BrokerConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import BIT_WIDTHS, block_bytes
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.planner.sizing import fitting_uniform_bits
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes

ROWS = ("bf16", *(f"static-{b}" for b in BIT_WIDTHS), "fitting-uniform", "pagedweight")
BF16_BYTES = 2
# Raise hysteresis: bytes go back to the weights after half a second of calm and only when 4 KV
# blocks' worth are spare (BrokerConfig says why).
BROKER = BrokerConfig(calm_seconds=0.5, offer_min_blocks=4)
KL_DOMAIN, KL_SEQ_LEN, KL_PLANS = "kjv", 128, 8  # held-out text, window, most-served plans scored
TRACES = ("closed", "steady", "bursty", "long-context")
BURST_PERIOD_S, BURST_S, BURST_FACTOR = 20.0, 5.0, 3.0  # bursty: 5 s of each 20 at 3x the mean rate


def parse_args():
    parser = arg_parser(__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", type=Path, help="paged artifact directory (from pagedweight quantize)")
    what.add_argument("--shape", help="a real-shape config (offline/real_shape_models.CONFIGS; random weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trace", default="closed", choices=TRACES)
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrival traces: arrivals over this long")
    parser.add_argument("--rate", type=float, default=4.0, help="arrival traces: mean requests a second")
    parser.add_argument("--long-prompts", type=int, nargs=2, default=(4096, 16384), metavar=("MIN", "MAX"),
                        help="long-context: prompt lengths, uniform")
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--num-budgets", type=int, default=5)
    parser.add_argument("--kl", action="store_true", help="--artifact: KL to bf16 of the plans each row served")
    parser.add_argument("--kl-windows", type=int, default=4, help=f"--kl: windows of {KL_SEQ_LEN} tokens scored")
    parser.add_argument("--row-time-limit-s", type=float, default=120.0, help="bf16 rows: stop the trace then")
    parser.add_argument("--time-limit-s", type=float, default=1e9, help="start no row after this")
    parser.add_argument("--name", default=None, help="result name (default: budget_sweep_<model>)")
    args = parser.parse_args()
    if args.num_budgets < 2:
        parser.error("--num-budgets must be >= 2 (the two ends of the sweep)")
    if args.trace != "closed" and (args.rate <= 0 or args.duration_s <= 0):
        parser.error("--rate and --duration-s must be positive")
    if not 0 < args.long_prompts[0] <= args.long_prompts[1]:
        parser.error("--long-prompts MIN MAX: 0 < MIN <= MAX")
    if args.kl and not args.artifact:
        parser.error("--kl needs --artifact (the bf16 reference is the artifact's source checkpoint)")
    args.device = torch.device(args.device)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    torch.set_num_threads(2)
    return args


@dataclass
class Model:
    paged: object  # the PagedModel every runtime is built from
    config: object  # its ModelConfig
    eos: list[int]
    name: str
    bf16: object = None  # the unquantised MoECausalLM the bf16 row serves


def load_model(args) -> Model:
    """The paged model, and beside it the unquantised one where a bf16 row needs it (the
    real-shape model's own, or the artifact's source experts)."""
    from pagedweight.format.paged_model import load_paged_model

    if args.artifact:
        from pagedweight.format.model_config import read_eos_token_ids
        from pagedweight.model.dequantized_experts import build_paged_lm
        from pagedweight.model.source_experts import attach_source_experts

        paged = load_paged_model(args.artifact, with_bf16=False)
        model = Model(paged, paged.config, read_eos_token_ids(args.artifact), args.artifact.name)
        if "bf16" in args.rows:
            with_bf16 = attach_source_experts(load_paged_model(args.artifact, with_bf16=True))
            model.bf16 = build_paged_lm(with_bf16, dtype=args.dtype, device=args.device)
        return model
    from pagedweight.format.model_config import ModelConfig
    from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf, paged_in_memory

    hf_model, raw = build_hf_model(args.shape, args.device, args.dtype)
    config = ModelConfig.from_dict(raw)
    ours = ours_from_hf(hf_model, config)
    del hf_model
    model = Model(paged_in_memory(ours, config, raw), config, config.eos_token_ids, args.shape,
                  ours if "bf16" in args.rows else None)
    del ours
    free_memory(args.device)
    return model


def model_sizes(model: Model, ecfg: EngineConfig, args) -> dict:
    elem = torch.empty((), dtype=args.dtype).element_size()
    dense = sum(t.numel() for t in model.paged.dense_state.values()) * elem
    workspace = workspace_bytes(model.config, ecfg, args.dtype)
    blocks = model.paged.meta["blocks"]
    return {"fixed": dense + workspace, "dense": dense, "workspace": workspace,
            "experts": {b: sum(block_bytes(x["rows"], x["cols"], b) for x in blocks) for b in BIT_WIDTHS},
            "experts_bf16": sum(x["rows"] * x["cols"] for x in blocks) * BF16_BYTES,
            "kv_wanted": args.concurrency * (longest_prompt(args) + args.max_tokens)
            * kv_block_bytes(model.config, 1, args.dtype)}


def longest_prompt(args) -> int:
    return args.long_prompts[1] if args.trace == "long-context" else args.prompt_len


def make_trace(args) -> list[tuple[float, int]]:
    """(arrival second, prompt length) of every request, from one seed. closed: all at 0 (the
    concurrency cap paces them); the others Poisson over --duration-s, bursty's rate 3x the mean
    for 5 s of every 20 and a third of it for the other 15 (the same mean)."""
    if args.trace == "closed":
        return [(0.0, args.prompt_len)] * args.requests
    rng, t, trace = random.Random(0), 0.0, []
    calm = (BURST_PERIOD_S - BURST_S * BURST_FACTOR) / (BURST_PERIOD_S - BURST_S)
    peak = BURST_FACTOR if args.trace == "bursty" else 1.0
    while True:  # candidates at the peak rate, each kept with probability rate(t) / peak (thinning)
        t += rng.expovariate(args.rate * peak)
        if t >= args.duration_s:
            return trace
        if args.trace == "bursty" and t % BURST_PERIOD_S >= BURST_S and rng.random() >= calm / peak:
            continue
        long = args.trace == "long-context"
        trace.append((t, rng.randint(*args.long_prompts) if long else args.prompt_len))


def budget_points(sizes: dict, num: int) -> list[int]:
    """`num` budgets from bf16 barely fitting the trace down to only 3 bits fitting it."""
    fixed, kv = sizes["fixed"], sizes["kv_wanted"]
    top = fixed + sizes["experts_bf16"] + kv
    bottom = fixed + kv + (sizes["experts"][3] + sizes["experts"][4]) // 2
    return [int(round(top + (bottom - top) * i / (num - 1))) for i in range(num)]


def warm_up(engine, args) -> None:
    """Kernels compiled and caches made before the clock starts: a short load, then (CUDA)
    every decode bucket once (each new attention split count compiles)."""
    drive_load(engine, LoadSpec(4, 4, args.prompt_len, 4, seed=1))
    if args.device.type == "cuda":
        warm_decode_buckets(engine)
    engine.kv.shrink()


def page_moves(runtime) -> int:
    """Block bit changes committed so far (a block lowered 8 -> 4 in one plan is one)."""
    c = runtime.mover.counters
    return c.num_lowerings + c.num_raises_committed


FREE_PLAN_COUNTS = ("planes_lowered", "planes_fewest", "blocks_lowered", "blocks_fewest", "bytes_freed", "bytes_asked")


def free_plan_counts(runtime) -> list[int]:
    """What the free plans lowered against the least that would have freed what each asked
    (FREE_PLAN_COUNTS: bit-planes, blocks, bytes; the pager's PagerStats)."""
    if runtime.pager is None:
        return [0] * len(FREE_PLAN_COUNTS)
    s = runtime.pager.stats()
    return [s.num_planes_lowered, s.num_planes_lowered_fewest, s.num_blocks_lowered, s.num_blocks_lowered_fewest,
            s.num_bytes_freed, s.num_bytes_asked]


def serve(engine, args, time_limit_s: float, runtime=None) -> dict:
    """The trace on `engine` until done or `time_limit_s` (the row then says how far it got);
    with `runtime`, the mean bits each step served at and, per committed bit plan, the tokens
    served at it (`_plans`: key -> [bits, tokens], the input of the KL)."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    vocab, in_flight = engine.model.config.vocab_size, set()
    pending = deque(make_trace(args))
    requests, cap = len(pending), args.concurrency if args.trace == "closed" else None
    sent = finished = tokens = 0
    bits, plans, moves = [], {}, None
    start = time.perf_counter()
    while (pending or in_flight) and (now := time.perf_counter() - start) < time_limit_s:
        while pending and pending[0][0] <= now and (cap is None or len(in_flight) < cap):
            prompt = torch.randint(1, vocab, (pending.popleft()[1],), generator=gen).tolist()
            engine.add_request(f"r{sent}", prompt, params)
            in_flight.add(f"r{sent}")
            sent += 1
        if not in_flight:  # an arrival trace between requests
            time.sleep(max(0.0, min(pending[0][0], time_limit_s) - now))
            continue
        step_tokens = 0
        for out in engine.step():
            step_tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
                finished += 1
        tokens += step_tokens
        if runtime is not None:
            if page_moves(runtime) != moves:  # a new plan committed
                moves = page_moves(runtime)
                committed = torch.tensor([e.committed_bits for e in runtime.table.entries.values()], dtype=torch.int8)
                key, mean = committed.numpy().tobytes(), mean_committed_bits(runtime)
            plans.setdefault(key, [committed, 0])[1] += step_tokens
            bits.append((mean, step_tokens))
    elapsed = time.perf_counter() - start
    row = {"elapsed_s": round(elapsed, 3), "output_tokens": tokens, "trace": args.trace, "requests": requests,
           "requests_finished": finished, "output_tokens_per_s": round(tokens / elapsed, 2)}
    if bits:
        row.update({"bits_mean_min": round(min(b for b, _ in bits), 4),
                    "bits_mean_served": round(sum(b * t for b, t in bits) / max(tokens, 1), 4), "_plans": plans,
                    "_block_keys": [b.key() for b in runtime.table.entries]})
    return row


def run_bf16(model: Model, ecfg, budget: int, sizes: dict, args) -> dict:
    """The dense engine with the KV blocks the budget leaves beside bf16 experts."""
    block = ecfg.kv.block_size
    room = budget - sizes["fixed"] - sizes["experts_bf16"]
    num_blocks = room // kv_block_bytes(model.config, block, args.dtype) if room > 0 else 0
    per_request = -(-(longest_prompt(args) + args.max_tokens) // block)
    if num_blocks < per_request:
        return {"refused": f"bf16 weights leave {max(room, 0)} bytes: {num_blocks} KV blocks, "
                           f"one request needs {per_request}"}
    engine = Engine(model.bf16, replace(ecfg, num_kv_blocks=int(num_blocks)))
    warm_up(engine, args)
    before = engine.stats()
    row = serve(engine, args, args.row_time_limit_s)
    stats = engine.stats()
    return {**row, "kv_blocks": int(num_blocks), "preemptions": stats.num_preemptions - before.num_preemptions,
            "memory_short_steps": stats.memory_short_steps - before.memory_short_steps, "page_moves": 0,
            "bits_mean_served": 16.0, "kl_served": 0.0 if args.kl else None}


def run_paged(model: Model, policy: str, budget: int, ecfg, args) -> dict:
    """A policy's runtime at the budget, on the trace."""
    config = RuntimeConfig(budget, policy, device=str(args.device), dtype=args.dtype, engine=ecfg)
    try:
        rt = build_runtime_from_paged(model.paged, config, model.eos)
    except Exception as err:  # noqa: BLE001 - a budget a policy cannot start in is a result
        return {"refused": str(err).splitlines()[0]}
    try:
        try:
            warm_up(rt.engine, args)
        except UserError as err:  # the KV room the width leaves cannot hold one request
            return {"refused": str(err).splitlines()[0]}
        moves0, counts0 = page_moves(rt), free_plan_counts(rt)
        row = serve(rt.engine, args, 1e9, runtime=rt)
        stats = rt.engine.stats()
        counts = {k: b - a for k, a, b in zip(FREE_PLAN_COUNTS, counts0, free_plan_counts(rt))}
        return {**row, "preemptions": stats.num_preemptions, "memory_short_steps": stats.memory_short_steps,
                "page_moves": page_moves(rt) - moves0, **counts}
    finally:
        rt.close()
        del rt
        free_memory(args.device)


def run_row(model: Model, point: dict, row_name: str, ecfg, sizes: dict, args) -> dict:
    fitting = point["fitting_uniform_bits"]
    log(f"budget {point['budget'] / 2**20:.1f} MiB (fitting uniform width {fitting}): {row_name}")
    if row_name == "fitting-uniform":
        return ({"refused": "no uniform width fits beside the trace's KV"}
                if fitting is None else {"same_run_as": f"static-{fitting}"})
    if row_name == "bf16":
        row = run_bf16(model, ecfg, point["budget"], sizes, args)
    else:
        row = run_paged(model, row_name, point["budget"], ecfg, args)
    log(f"  {row_name}: " + (row.get("refused") or f"{row['output_tokens_per_s']} tok/s, "
                             f"{row['preemptions']} preemptions, {row['page_moves']} moves, "
                             f"bits served {row['bits_mean_served']}"))
    return row


def kl_of_plans(args, rows: dict, scorer) -> None:
    """Token-weighted KL(bf16 || served) of the plans each row served most, into each row."""
    ids = scorer.tokenizer.encode((corpus_dir() / f"{KL_DOMAIN}.valid.txt").read_text())
    windows = windows_of(ids, KL_SEQ_LEN, args.kl_windows)
    order = {b.key(): i for i, b in enumerate(scorer.table.block_ids)}
    for name, row in rows.items():
        plans = row.pop("_plans")
        top = sorted(plans.values(), key=lambda p: -p[1])[:KL_PLANS]
        weighted = weight = 0.0
        for bits, tokens in top:
            aligned = [0] * len(order)
            for key, b in zip(row["_block_keys"], bits.tolist()):
                aligned[order[key]] = b
            weighted += scorer.kl(torch.tensor(aligned).numpy(), KL_DOMAIN, windows) * tokens
            weight += tokens
        row["kl_served"] = round(weighted / max(weight, 1), 6)
        row["kl_tokens_covered"] = round(weight / max(sum(t for _, t in plans.values()), 1), 4)
        log(f"  KL {name}: {row['kl_served']:.5f} ({row['kl_tokens_covered']:.0%} of tokens)")


def public(result: dict) -> dict:
    """The result without the rows' private fields (plans, block keys: inputs to the KL)."""
    return {**result, "budgets": [{**p, "rows": {r: {k: v for k, v in row.items() if not k.startswith("_")}
                                                 for r, row in p["rows"].items()}} for p in result["budgets"]]}


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    model = load_model(args)
    ecfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=args.concurrency,
                                                  max_num_batched_tokens=args.batched_tokens),
                        kv=KVCacheConfig(), broker=BROKER)
    sizes = model_sizes(model, ecfg, args)
    name = args.name or f"budget_sweep_{model.name}" + ("" if args.trace == "closed" else f"_{args.trace}")
    points = [{"budget": b, "budget_gib": round(b / 2**30, 4),
               "fitting_uniform_bits": fitting_uniform_bits(sizes["experts"], sizes["fixed"], sizes["kv_wanted"], b),
               "rows": {}} for b in budget_points(sizes, args.num_budgets)]
    result = {"model": {"artifact": str(args.artifact)} if args.artifact else {"shape": args.shape},
              "dtype": str(args.dtype), "args": {k: str(v) for k, v in vars(args).items()}, "bytes": sizes,
              "budgets": points}
    # bf16 first at every budget, so its model can go before the paged runtimes are built
    order = [(p, r) for r in args.rows if r == "bf16" for p in points] + \
            [(p, r) for p in points for r in args.rows if r != "bf16"]
    for point, row_name in order:
        if time.perf_counter() - started > args.time_limit_s:
            point["rows"][row_name] = {"skipped": "time limit"}
            continue
        if row_name != "bf16" and model.bf16 is not None:
            model.bf16 = None
            free_memory(args.device)
        point["rows"][row_name] = run_row(model, point, row_name, ecfg, sizes, args)
        write_result(name, public(result))  # each row as it lands, in case the call ends early
    if args.kl:
        scorer = Scorer(Path(args.artifact))
        for point in points:
            kl_of_plans(args, {k: v for k, v in point["rows"].items() if "_plans" in v}, scorer)
    log(f"wrote {write_result(name, public(result))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
