"""The comparison at a sweep of memory budgets: bf16 in the same memory, every static width, the
fitting uniform width and the elastic policy, one run each per budget, throughput beside quality.

Budgets: `--num-budgets` points, evenly spaced, from "bf16 barely fits" (non-expert weights +
workspace + every expert in bf16 + all the KV the trace wants) down to "only 3 bits fits" (the
same with every expert at 3 bits, plus half the step to 4 bits: 4 bits no longer fits beside
the trace's KV). Each budget is the whole device budget every row gets.

Rows per budget, each on the same steady closed-loop trace (bench/elasticity.py's driver,
same prompts, EOS ignored):
- `bf16`: our engine over the unquantised experts with the KV blocks the budget leaves once
  bf16 weights are charged: it must preempt and recompute when that is less than the trace
  wants, and is `refused` when one request's KV does not fit;
- `static-B`, B = 3..8: every expert pinned at B bits (`refused` where B's experts and one
  request's KV do not fit);
- `fitting-uniform`: the widest B whose experts fit beside the trace's whole KV demand
  (planner.sizing.fitting_uniform_bits), the uniform-quantisation baseline; it is the
  `static-B` run of that B, named so;
- `pagedweight`: the elastic policy.
With `--kl` (an artifact whose source checkpoint is at hand, CPU) every row also carries the
token-weighted KL(bf16 || served) of the bit plans it served, on held-out text (the corpus's
valid split); bf16 is the reference (0).

The expert bytes of the bf16 row count 2 bytes a weight whatever the compute dtype (on CPU the
engine computes in fp32; the budget is the bf16 deployment's).

    .venv/bin/python -m bench.budget_sweep --artifact ART/tiny-qwen-moe --device cpu --kl
    PYTHONPATH=.:services:kernels python3 -m bench.budget_sweep --shape qwen1.5-moe-a2.7b --device cuda
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import elasticity as el
from bench.bench_meta import write_result
from pagedweight.common.errors import UserError
from pagedweight.engine.engine import Engine
from pagedweight.engine.sampler import SamplingParams
from pagedweight.format.apl_format import BIT_WIDTHS, block_bytes
from pagedweight.memory.kv_cache import kv_block_bytes
from pagedweight.planner.sizing import fitting_uniform_bits
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged

ROWS = ("bf16", *(f"static-{b}" for b in BIT_WIDTHS), "fitting-uniform", "pagedweight")
BF16_BYTES = 2


def budget_points(sizes: dict, num: int) -> list[int]:
    """`num` budgets from bf16 barely fitting the trace down to only 3 bits fitting it."""
    fixed, kv = sizes["fixed"], sizes["kv_wanted"]
    top = fixed + sizes["experts_bf16"] + kv
    bottom = fixed + kv + (sizes["experts"][3] + sizes["experts"][4]) // 2
    return [int(round(top + (bottom - top) * i / (num - 1))) for i in range(num)]


def model_sizes(paged, config, ecfg, dtype, args) -> dict:
    blocks = paged.meta["blocks"]
    experts = {b: sum(block_bytes(x["rows"], x["cols"], b) for x in blocks) for b in BIT_WIDTHS}
    base = el.budget_bytes(paged, config, ecfg, dtype, args)
    return {"fixed": base["dense"] + base["workspace"], "dense": base["dense"], "workspace": base["workspace"],
            "experts": experts, "experts_bf16": sum(x["rows"] * x["cols"] for x in blocks) * BF16_BYTES,
            "kv_wanted": base["kv_wanted"]}


def run_bf16(bf16_model, config, ecfg, budget: int, sizes: dict, dtype, args) -> dict:
    """The dense engine with the KV blocks the budget leaves beside bf16 experts."""
    block = ecfg.kv.block_size
    room = budget - sizes["fixed"] - sizes["experts_bf16"]
    num_blocks = room // kv_block_bytes(config, block, dtype) if room > 0 else 0
    per_request = -(-(args.prompt_len + args.max_tokens) // block)
    if num_blocks < per_request:
        return {"refused": f"bf16 weights leave {max(room, 0)} bytes: {num_blocks} KV blocks, "
                           f"one request needs {per_request}"}
    from dataclasses import replace

    engine = Engine(bf16_model, replace(ecfg, num_kv_blocks=int(num_blocks)))
    warm_up(engine, args.prompt_len, bf16_model.device)
    before = engine.stats()
    row = drive_plain(engine, args)
    stats = engine.stats()
    row.update({"kv_blocks": int(num_blocks), "preemptions": stats.num_preemptions - before.num_preemptions,
                "memory_short_steps": stats.memory_short_steps - before.memory_short_steps, "page_moves": 0,
                "bits_mean_served": 16.0,
                "kl_served": 0.0 if args.kl else None})
    return row


def drive_plain(engine, args) -> dict:
    """elasticity.drive_trace's steady trace (same prompts, same order) on an engine without a
    pager: tokens/s only. Stops after --row-time-limit-s (an engine that preempts and
    recomputes more than it decodes may never finish): the row then says how far it got."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    sent = tokens = finished = 0
    in_flight: set[str] = set()
    start = time.perf_counter()
    while (sent < args.requests or in_flight) and time.perf_counter() - start < args.row_time_limit_s:
        while sent < args.requests and len(in_flight) < args.concurrency:
            prompt = torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(f"r{sent}", prompt, params)
            in_flight.add(f"r{sent}")
            sent += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
                finished += 1
    elapsed = time.perf_counter() - start
    return {"elapsed_s": round(elapsed, 3), "output_tokens": tokens, "requests": args.requests,
            "requests_finished": finished, "output_tokens_per_s": round(tokens / elapsed, 2)}


def run_paged(paged, eos, policy: str, budget: int, ecfg, dtype, device, args) -> dict:
    config = RuntimeConfig(budget, policy, device=str(device), dtype=dtype, engine=ecfg)
    try:
        rt = build_runtime_from_paged(paged, config, eos)
    except Exception as err:  # noqa: BLE001 - a budget a policy cannot start in is a result
        return {"refused": str(err).splitlines()[0]}
    try:
        try:
            warm_up(rt.engine, args.prompt_len, device)
        except UserError as err:  # the KV room the width leaves cannot hold one request
            return {"refused": str(err).splitlines()[0]}
        moves0 = el._moves(rt)
        frees = MovesAgainstMinimum(rt.pager.planner) if rt.pager is not None else None
        row = el.drive_trace(rt, [el.Phase(args.requests, args.concurrency)], args.prompt_len,
                             args.max_tokens, args.drain_s, None)
        stats = rt.engine.stats()
        row.pop("samples")
        row.update({"preemptions": stats.num_preemptions, "memory_short_steps": stats.memory_short_steps,
                    "page_moves": el._moves(rt) - moves0, "_block_keys": [b.key() for b in rt.table.entries]})
        if frees is not None:
            row["frees_against_minimum"] = frees.summary()
        return row
    finally:
        rt.close()
        del rt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


class MovesAgainstMinimum:
    """Per free request (one pressure change) the planner answers: the blocks its plan moves
    against the fewest blocks that could free those bytes at all (the blocks with the most
    bytes above 3 bits first, each lowered to 3), wrapped around the planner's submit/poll."""

    def __init__(self, planner):
        self.planner, self.pairs = planner, []  # pairs: (blocks moved, minimum)
        submit, poll = planner.submit, planner.poll
        pending = {}  # request_id -> minimum blocks

        def on_submit(request):
            if request.pressure.bytes_needed > 0:
                pending[request.request_id] = self.minimum(request.bits, request.pressure.bytes_needed)
            submit(request)

        def on_poll():
            response = poll()
            if response is not None and response.request_id in pending:
                self.pairs.append((len(response.block_indices), pending.pop(response.request_id)))
            return response

        planner.submit, planner.poll = on_submit, on_poll

    def minimum(self, bits: np.ndarray, num_bytes: int) -> int:
        nbytes = self.planner.table.nbytes
        above = np.sort(nbytes[np.arange(len(bits)), bits - BIT_WIDTHS[0]] - nbytes[:, 0])[::-1]
        return int(min(np.searchsorted(np.cumsum(above), num_bytes) + 1, len(bits)))

    def summary(self) -> dict:
        moved = sum(m for m, _ in self.pairs)
        least = sum(n for _, n in self.pairs)
        ratios = [m / n for m, n in self.pairs if n]
        return {"free_requests": len(self.pairs), "blocks_moved": moved, "minimum_blocks": least,
                "moved_over_minimum": round(moved / least, 3) if least else None,
                "worst_ratio": round(max(ratios), 3) if ratios else None}


def warm_up(engine, prompt_len: int, device) -> None:
    """A short load before the clock starts, and every decode bucket on CUDA. Not
    elasticity.warm_up's tour of every bit-width: at the low budgets here the arena cannot
    take every block back to its starting bits while the warm-up's KV is still held."""
    from pagedweight.cli.load_bench import LoadSpec, drive_load
    from pagedweight.engine.graph_warmup import warm_decode_buckets

    drive_load(engine, LoadSpec(4, 4, prompt_len, 4, seed=1))
    if device.type == "cuda":
        warm_decode_buckets(engine)
    if hasattr(engine.kv, "shrink"):
        engine.kv.shrink()


def bf16_model_of(args, paged, ours_bf16, dtype, device):
    """The unquantised model the bf16 row serves: the artifact's source experts, or the
    real-shape model's own."""
    if ours_bf16 is not None:
        return ours_bf16
    from pagedweight.format.paged_model import load_paged_model
    from pagedweight.model.dequantized_experts import build_paged_lm
    from pagedweight.model.source_experts import attach_source_experts

    with_bf16 = attach_source_experts(load_paged_model(args.artifact, with_bf16=True))
    return build_paged_lm(with_bf16, dtype=dtype, device=device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", type=Path, help="paged artifact directory (from pagedweight quantize)")
    what.add_argument("--shape", help="a real-shape config (random weights; no --kl)")
    parser.add_argument("--layers", type=int, default=None, help="--shape: keep this many layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--num-budgets", type=int, default=5)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--row-time-limit-s", type=float, default=120.0,
                        help="bf16 rows: stop the trace after this long (preemption can thrash)")
    parser.add_argument("--drain-s", type=float, default=0.0, help="idle steps after the trace (bits coming back)")
    parser.add_argument("--kl", action="store_true", help="--artifact: KL to bf16 of the plans each row served")
    parser.add_argument("--kl-domain", default="kjv")
    parser.add_argument("--kl-seq-len", type=int, default=128)
    parser.add_argument("--kl-windows", type=int, default=4)
    parser.add_argument("--kl-plans", type=int, default=8, help="most-served plans scored per row")
    parser.add_argument("--time-limit-s", type=float, default=1e9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None, help="write the throughput / KL plot here (PNG)")
    parser.add_argument("--name", default=None, help="result name (default: budget_sweep_<model>)")
    args = parser.parse_args()
    if args.num_budgets < 2:
        parser.error("--num-budgets must be >= 2 (the two ends of the sweep)")
    if args.kl and not args.artifact:
        parser.error("--kl needs --artifact (the bf16 reference is the artifact's source checkpoint)")
    # what elasticity's helpers read
    for key, value in {"kv_fraction": 1.0, "calm_steps": 16, "calm_seconds": 0.5, "offer_min_blocks": 4,
                       "ask_ahead_blocks": 0, "offer_min_used_fraction": el.BrokerConfig.offer_min_used_fraction,
                       "no_project_demand": False, "no_ask_before_short": False, "graphs_per_bucket": 1}.items():
        setattr(args, key, value)
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    ours_bf16 = None
    if args.shape:
        ours_bf16, paged, config, eos, built = load_shape(args, device, dtype)
    else:
        paged, config, eos, built = el.load_model(args, device, dtype)
    ecfg = el.engine_config(args)
    sizes = model_sizes(paged, config, ecfg, dtype, args)
    budgets = budget_points(sizes, args.num_budgets)
    name = args.name or f"budget_sweep_{built.get('shape') or Path(args.artifact).name}"
    result = {"model": built, "dtype": str(dtype), "args": {k: str(v) for k, v in vars(args).items()},
              "bytes": sizes, "budgets": []}
    bf16_model = bf16_model_of(args, paged, ours_bf16, dtype, device) if "bf16" in args.rows else None
    ours_bf16 = None  # held by bf16_model where a bf16 row needs it; else its device memory goes now
    gc.collect()
    scorer = None
    if args.kl:
        from bench.quality_budget import Scorer

        scorer = Scorer(Path(args.artifact))
    points = [{"budget": b, "budget_gib": round(b / 2**30, 4),
               "fitting_uniform_bits": fitting_uniform_bits(sizes["experts"], sizes["fixed"], sizes["kv_wanted"], b),
               "rows": {}} for b in budgets]
    result["budgets"] = points
    # bf16 first at every budget, so its model can go before the paged runtimes are built
    order = [(p, r) for r in args.rows if r == "bf16" for p in points] + \
            [(p, r) for p in points for r in args.rows if r != "bf16"]
    for point, row_name in order:
        fitting = point["fitting_uniform_bits"]
        if time.perf_counter() - started > args.time_limit_s:
            point["rows"][row_name] = {"skipped": "time limit"}
            continue
        el.log(f"budget {point['budget'] / 2**20:.1f} MiB (fitting uniform width {fitting}): {row_name}")
        if row_name == "fitting-uniform":
            point["rows"][row_name] = ({"refused": "no uniform width fits beside the trace's KV"}
                                       if fitting is None else {"same_run_as": f"static-{fitting}"})
            continue
        if row_name == "bf16":
            row = run_bf16(bf16_model, config, ecfg, point["budget"], sizes, dtype, args)
        else:
            if bf16_model is not None:
                bf16_model = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row = run_paged(paged, eos, row_name, point["budget"], ecfg, dtype, device, args)
        point["rows"][row_name] = row
        el.log(f"  {row_name}: " + (row.get("refused") or f"{row['output_tokens_per_s']} tok/s, "
                                    f"{row['preemptions']} preemptions, {row['page_moves']} moves, "
                                    f"bits served {row['bits_mean_served']}"))
        path = write_result(name, _clean(result))
    if scorer is not None:
        for point in points:
            el.kl_of_plans(args, {k: v for k, v in point["rows"].items() if "_plans" in v}, scorer)
    path = write_result(name, _clean(result))
    if args.plot:
        pareto_plot(result, args.plot)
    el.log(f"wrote {path}")
    return 0


def pareto_plot(result: dict, path: Path) -> None:
    """Throughput against KL to bf16, one point per row and budget (refused rows left out),
    each row's budgets joined from the largest to the smallest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [n for n in ROWS if n != "fitting-uniform" and any(n in p["rows"] for p in result["budgets"])]
    for name in names:
        points = [(p["rows"][name].get("kl_served"), p["rows"][name].get("output_tokens_per_s"))
                  for p in result["budgets"] if name in p["rows"]]
        points = [(kl, tps) for kl, tps in points if kl is not None and tps is not None]
        if points:
            kl, tps = zip(*points)
            ax.plot([max(k, 1e-5) for k in kl], tps, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("KL(bf16 || served), nats per token (bf16 drawn at 1e-5)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']}: {len(result['budgets'])} budgets, one point each", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    el.log(f"wrote {path}")


def _clean(result: dict) -> dict:
    """The result without the rows' private fields (plans, block keys: inputs to the KL)."""
    return {**result, "budgets": [{**p, "rows": {r: {k: v for k, v in row.items() if not k.startswith("_")}
                                                  for r, row in p["rows"].items()}} for p in result["budgets"]]}


def load_shape(args, device, dtype):
    """A real-shape model with random weights: its bf16 model and the paged model made from it."""
    from pagedweight.format.model_config import ModelConfig
    from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf, paged_in_memory

    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    hf_model, raw = build_hf_model(args.shape, device, dtype, overrides)
    config = ModelConfig.from_dict(raw)
    ours = ours_from_hf(hf_model, config)
    del hf_model
    paged = paged_in_memory(ours, config, raw)
    gc.collect()
    return ours, paged, config, config.eos_token_ids, {"shape": args.shape, "layers": config.num_layers}


if __name__ == "__main__":
    sys.exit(main())
