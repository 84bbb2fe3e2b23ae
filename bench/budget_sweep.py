"""The comparison at a sweep of memory budgets: bf16 in the same memory, every static width, the
fitting uniform width and the elastic policy, one run each per budget, throughput beside quality.

Budgets: `--num-budgets` points, evenly spaced, from "bf16 barely fits" (non-expert weights +
workspace + every expert in bf16 + all the KV the trace wants) down to "only 3 bits fits" (the
same with every expert at 3 bits, plus half the step to 4 bits: 4 bits no longer fits beside
the trace's KV). Each budget is the whole device budget every row gets.

Rows per budget, each on the same steady closed-loop trace (bench/trace_runs.py, the trace
bench/elasticity.py serves):
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

    python -m bench run budget-sweep-cpu       # the trained tiny Qwen-MoE, with the KL
    python -m bench run budget-sweep-qwen-a    # GPU: Qwen1.5-MoE, 24 layers, half the rows (-b: the rest)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import trace_runs as tr
from bench.bench_meta import log, write_result
from pagedweight.common.errors import UserError
from pagedweight.engine.engine import Engine
from pagedweight.format.apl_format import BIT_WIDTHS, block_bytes
from pagedweight.memory.kv_cache import kv_block_bytes
from pagedweight.planner.sizing import fitting_uniform_bits
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged

ROWS = ("bf16", *(f"static-{b}" for b in BIT_WIDTHS), "fitting-uniform", "pagedweight")
BF16_BYTES = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tr.add_args(parser)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--num-budgets", type=int, default=5)
    parser.add_argument("--row-time-limit-s", type=float, default=120.0,
                        help="bf16 rows: stop the trace after this long (preemption can thrash)")
    parser.add_argument("--drain-s", type=float, default=0.0, help="idle steps after the trace (bits coming back)")
    parser.add_argument("--name", default=None, help="result name (default: budget_sweep_<model>)")
    parser.add_argument("--plot", type=Path, default=None, help="write the throughput / KL plot here (PNG)")
    args = parser.parse_args()
    if args.num_budgets < 2:
        parser.error("--num-budgets must be >= 2 (the two ends of the sweep)")
    args.device, args.dtype = tr.device_and_dtype(args, parser)
    return args


def budget_points(sizes: dict, num: int) -> list[int]:
    """`num` budgets from bf16 barely fitting the trace down to only 3 bits fitting it."""
    fixed, kv = sizes["fixed"], sizes["kv_wanted"]
    top = fixed + sizes["experts_bf16"] + kv
    bottom = fixed + kv + (sizes["experts"][3] + sizes["experts"][4]) // 2
    return [int(round(top + (bottom - top) * i / (num - 1))) for i in range(num)]


def model_sizes(model: tr.Model, ecfg, args) -> dict:
    blocks = model.paged.meta["blocks"]
    experts = {b: sum(block_bytes(x["rows"], x["cols"], b) for x in blocks) for b in BIT_WIDTHS}
    base = tr.budget_bytes(model, ecfg, args.dtype, args, kv_fraction=1.0)
    return {"fixed": base["dense"] + base["workspace"], "dense": base["dense"], "workspace": base["workspace"],
            "experts": experts, "experts_bf16": sum(x["rows"] * x["cols"] for x in blocks) * BF16_BYTES,
            "kv_wanted": base["kv_wanted"]}


def run_bf16(bf16_model, config, ecfg, budget: int, sizes: dict, args) -> dict:
    """The dense engine with the KV blocks the budget leaves beside bf16 experts."""
    block = ecfg.kv.block_size
    room = budget - sizes["fixed"] - sizes["experts_bf16"]
    num_blocks = room // kv_block_bytes(config, block, args.dtype) if room > 0 else 0
    per_request = -(-(args.prompt_len + args.max_tokens) // block)
    if num_blocks < per_request:
        return {"refused": f"bf16 weights leave {max(room, 0)} bytes: {num_blocks} KV blocks, "
                           f"one request needs {per_request}"}
    engine = Engine(bf16_model, replace(ecfg, num_kv_blocks=int(num_blocks)))
    tr.warm_up(engine, args.prompt_len, 4, buckets=args.device.type == "cuda")
    before = engine.stats()
    row = tr.drive_plain(engine, args, args.row_time_limit_s)
    stats = engine.stats()
    row.update({"kv_blocks": int(num_blocks), "preemptions": stats.num_preemptions - before.num_preemptions,
                "memory_short_steps": stats.memory_short_steps - before.memory_short_steps, "page_moves": 0,
                "bits_mean_served": 16.0,
                "kl_served": 0.0 if args.kl else None})
    return row


def run_paged(model: tr.Model, policy: str, budget: int, ecfg, args) -> dict:
    """A policy's runtime at the budget, on the steady trace (no warm-up tour of every width:
    at the low budgets the arena cannot take every block back to its starting bits while the
    warm-up's KV is still held)."""
    config = RuntimeConfig(budget, policy, device=str(args.device), dtype=args.dtype, engine=ecfg)
    try:
        rt = build_runtime_from_paged(model.paged, config, model.eos)
    except Exception as err:  # noqa: BLE001 - a budget a policy cannot start in is a result
        return {"refused": str(err).splitlines()[0]}
    try:
        try:
            tr.warm_up(rt.engine, args.prompt_len, 4, buckets=args.device.type == "cuda")
        except UserError as err:  # the KV room the width leaves cannot hold one request
            return {"refused": str(err).splitlines()[0]}
        moves0 = tr.page_moves(rt)
        frees = MovesAgainstMinimum(rt.pager.planner) if rt.pager is not None else None
        row = tr.drive_trace(rt, [tr.Phase(args.requests, args.concurrency)], args.prompt_len,
                             args.max_tokens, args.drain_s, None)
        stats = rt.engine.stats()
        row.pop("samples")
        row.update({"preemptions": stats.num_preemptions, "memory_short_steps": stats.memory_short_steps,
                    "page_moves": tr.page_moves(rt) - moves0, "_block_keys": [b.key() for b in rt.table.entries]})
        if frees is not None:
            row["frees_against_minimum"] = frees.summary()
        return row
    finally:
        rt.close()
        del rt
        tr.free_memory(args.device)


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


def bf16_model_of(args, model: tr.Model):
    """The unquantised model the bf16 row serves: the real-shape model's own, or the
    artifact's source experts."""
    if model.bf16 is not None:
        return model.bf16
    from pagedweight.format.paged_model import load_paged_model
    from pagedweight.model.dequantized_experts import build_paged_lm
    from pagedweight.model.source_experts import attach_source_experts

    with_bf16 = attach_source_experts(load_paged_model(args.artifact, with_bf16=True))
    return build_paged_lm(with_bf16, dtype=args.dtype, device=args.device)


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    model = tr.load_model(args, args.device, args.dtype, keep_bf16="bf16" in args.rows)
    ecfg = tr.engine_config(args)
    sizes = model_sizes(model, ecfg, args)
    name = args.name or f"budget_sweep_{model.name}"
    points = [{"budget": b, "budget_gib": round(b / 2**30, 4),
               "fitting_uniform_bits": fitting_uniform_bits(sizes["experts"], sizes["fixed"], sizes["kv_wanted"], b),
               "rows": {}} for b in budget_points(sizes, args.num_budgets)]
    result = {"model": model.built, "dtype": str(args.dtype), "args": {k: str(v) for k, v in vars(args).items()},
              "bytes": sizes, "budgets": points}
    bf16_model = bf16_model_of(args, model) if "bf16" in args.rows else None
    model.bf16 = None  # held by bf16_model where a bf16 row needs it; else its device memory goes now
    tr.free_memory(args.device)
    # bf16 first at every budget, so its model can go before the paged runtimes are built
    order = [(p, r) for r in args.rows if r == "bf16" for p in points] + \
            [(p, r) for p in points for r in args.rows if r != "bf16"]
    for point, row_name in order:
        if time.perf_counter() - started > args.time_limit_s:
            point["rows"][row_name] = {"skipped": "time limit"}
            continue
        if row_name != "bf16" and bf16_model is not None:
            bf16_model = None
            tr.free_memory(args.device)
        point["rows"][row_name] = run_row(model, bf16_model, point, row_name, ecfg, sizes, args)
        path = write_result(name, public(result))
    if args.kl:
        from bench.quality_budget import Scorer

        scorer = Scorer(Path(args.artifact))
        for point in points:
            tr.kl_of_plans(args, {k: v for k, v in point["rows"].items() if "_plans" in v}, scorer)
    path = write_result(name, public(result))
    if args.plot:
        pareto_plot(json.loads(path.read_text()), args.plot)
    log(f"wrote {path}")
    return 0


def run_row(model: tr.Model, bf16_model, point: dict, row_name: str, ecfg, sizes: dict, args) -> dict:
    fitting = point["fitting_uniform_bits"]
    log(f"budget {point['budget'] / 2**20:.1f} MiB (fitting uniform width {fitting}): {row_name}")
    if row_name == "fitting-uniform":
        return ({"refused": "no uniform width fits beside the trace's KV"}
                if fitting is None else {"same_run_as": f"static-{fitting}"})
    if row_name == "bf16":
        row = run_bf16(bf16_model, model.config, ecfg, point["budget"], sizes, args)
    else:
        row = run_paged(model, row_name, point["budget"], ecfg, args)
    log(f"  {row_name}: " + (row.get("refused") or f"{row['output_tokens_per_s']} tok/s, "
                             f"{row['preemptions']} preemptions, {row['page_moves']} moves, "
                             f"bits served {row['bits_mean_served']}"))
    return row


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
    log(f"wrote {path}")


def public(result: dict) -> dict:
    """The result without the rows' private fields (plans, block keys: inputs to the KL)."""
    return {**result, "budgets": [{**p, "rows": {r: tr.public(row) for r, row in p["rows"].items()}}
                                  for p in result["budgets"]]}


if __name__ == "__main__":
    sys.exit(main())
