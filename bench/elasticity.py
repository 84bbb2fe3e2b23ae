"""Precision elasticity under pressure traces: the same trace for every policy at one memory
budget, with what moving the split cost and what it bought.

Policies: `pagedweight` (bits follow the KV pressure), `static-8/4/3` (bits pinned) and
`uniform` (the planner's uniform policy: one bit-width for every block that fits the
budget, re-planned from scratch under pressure); `POLICY:all-kv` runs a policy at a budget
with all the KV the load wants (`static-8:all-kv`: the ceiling of any policy at 8 bits).
Traces (closed loop, bench/trace_runs.py):
- `steady`: a steady overload, `--requests` requests `--concurrency` at a time;
- `burst`: a low load (concurrency `--low`), a burst at `--concurrency`, the low load again,
  then idle: how long after the burst's last request finishes the mean bits take to come
  back to where they started, and page moves per request.
Budget: non-expert weights + workspace + every expert at 8 bits + `--kv-fraction` of the KV
the steady load wants (default half), so static-8 must queue or preempt.

Per policy and trace: output tokens/s, preemptions, steps that waited for KV bytes, page
moves, bytes copied (host->device raises, device->device compaction), mean bits at start /
min / end and served (token-weighted), the pager's profile, and every step's sample
(trace_runs.SAMPLE_FIELDS). A discarded run of the
first trace comes first, so no policy pays the process's first-run costs. With `--kl` (an
artifact whose source checkpoint is at hand, CPU), the token-weighted KL(bf16 || served) of
the bit plans each trace served.

    python -m bench run elasticity-qwen          # GPU: Qwen1.5-MoE width, 12 layers
    .venv/bin/python -m bench.elasticity --artifact ART/tiny-qwen-moe --device cpu --kl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import trace_runs as tr
from bench.bench_meta import commit, log, write_result
from pagedweight.common.gc_pauses import freeze_startup_heap, unfreeze
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged
from pagedweight_kernels.apl_moe import compile_stats

POLICIES = ("pagedweight", "static-8", "static-4", "static-3", "uniform")
ALL_KV = "all-kv"  # the policy suffix for a budget holding all the KV the load wants


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tr.add_args(parser)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--traces", nargs="+", default=["steady", "burst"])
    parser.add_argument("--low", type=int, default=8, help="burst trace: concurrency before and after")
    parser.add_argument("--low-requests", type=int, default=16)
    parser.add_argument("--kv-fraction", type=float, default=0.5, help="KV room at 8 bits / KV the load wants")
    parser.add_argument("--drain-s", type=float, default=12.0)
    args = parser.parse_args()
    for policy in args.policies:
        if policy.partition(":")[2] not in ("", ALL_KV):
            parser.error(f"policy {policy!r}: the one variant is :{ALL_KV}")
    args.device, args.dtype = tr.device_and_dtype(args, parser)
    return args


def traces(args) -> dict[str, list[tr.Phase]]:
    return {
        "steady": [tr.Phase(args.requests, args.concurrency)],
        "burst": [tr.Phase(args.low_requests, args.low), tr.Phase(args.requests, args.concurrency),
                  tr.Phase(args.low_requests, args.low)],
    }


def run_order(trace_names: list[str], policies: list[str]) -> list[tuple[str, str]]:
    """What a time limit should cut last first: pagedweight against static-8 and static-4
    on every trace, then the other baselines."""
    first = [p for p in ("pagedweight", "static-8", "static-4") if p in policies]
    runs = [(t, p) for t in trace_names for p in first]
    return runs + [(t, p) for t in trace_names for p in policies if p not in first]


class Run:
    """The model, its budget and the engine's config, shared by every (trace, policy)."""

    def __init__(self, args):
        self.args = args
        self.model = tr.load_model(args, args.device, args.dtype)
        self.ecfg = tr.engine_config(args)
        self.sizes = tr.budget_bytes(self.model, self.ecfg, args.dtype, args, args.kv_fraction)

    def config(self, policy: str) -> RuntimeConfig:
        base, _, variant = policy.partition(":")
        budget = self.sizes["budget_all_kv"] if variant == ALL_KV else self.sizes["budget"]
        return RuntimeConfig(budget, base, device=str(self.args.device), dtype=self.args.dtype, engine=self.ecfg)

    def runtime(self, policy: str):
        return build_runtime_from_paged(self.model.paged, self.config(policy), self.model.eos)

    def warm_trace(self, trace: str, policy: str) -> None:
        """The first measured row's trace once, on a runtime of its own, discarded: what a
        process pays the first time it meets the trace's shapes (the first policy's mixed
        prefill steps took twice as long as the same policy's later in the process) is then
        paid before every row alike."""
        log("warm-up trace (discarded)")
        rt = self.runtime(policy)
        try:
            tr.warm_up(rt.engine, self.args.prompt_len, 16, runtime=rt)
            drive(rt, self.args, trace, min(self.args.drain_s, 2.0))
        finally:
            rt.close()
            del rt
            tr.free_memory(self.args.device)

    def row(self, trace: str, policy: str, warm: bool) -> dict:
        """One policy's run of one trace on a runtime of its own (after the discarded one where
        `warm`)."""
        try:
            if warm:
                self.warm_trace(trace, policy)
            rt = self.runtime(policy)
        except Exception as err:  # noqa: BLE001 - a policy that cannot start is a result too
            log(f"  {policy}: {err!r}")
            return {"error": repr(err)}
        tr.warm_up(rt.engine, self.args.prompt_len, 16, runtime=rt)
        freeze_startup_heap()  # as the worker does once warmed up (worker/server.py)
        before = Counters(rt)
        row = drive(rt, self.args, trace, self.args.drain_s)
        row.update(before.since(rt, row["requests"]))
        rt.close()
        del rt
        unfreeze()  # the runtime's objects: collectable again
        tr.free_memory(self.args.device)
        return row


def drive(rt, args, trace: str, drain_s: float) -> dict:
    return tr.drive_trace(rt, traces(args)[trace], args.prompt_len, args.max_tokens, drain_s,
                          1 if trace == "burst" else None)


class Counters:
    """What the runtime has counted before a trace, so a row reports the trace's own."""

    def __init__(self, rt):
        self.gc = (tr.GC.seconds, tr.GC.full_seconds, tr.GC.num_full)
        rt.table.num_descriptor_updates, rt.table.descriptor_seconds = 0, 0.0
        if rt.pager is not None:
            rt.pager.mover.profile.reset()
        self.moves, self.plans = tr.page_moves(rt), rt.pager.num_plans if rt.pager is not None else 0
        graphs = rt.engine.runner.graphs  # None: decode steps run eagerly (CPU)
        self.captures = (graphs.num_captures, graphs.capture_seconds, graphs.capture_warmup_seconds) \
            if graphs is not None else None
        self.compiles = compile_stats()

    def since(self, rt, num_requests: int) -> dict:
        compiles, stats, gc0 = compile_stats(), rt.engine.stats(), self.gc
        out = {"gc_s": round(tr.GC.seconds - gc0[0], 4), "gc_full_s": round(tr.GC.full_seconds - gc0[1], 4),
               "gc_full_collections": tr.GC.num_full - gc0[2],
               # fused-kernel instances first met inside the trace (0 after precompile)
               "kernel_compiles": compiles.count - self.compiles.count,
               "kernel_compile_s": round(compiles.seconds - self.compiles.seconds, 3)}
        graphs = rt.engine.runner.graphs
        if graphs is not None:  # a bit-class change in any layer re-captures each bucket it meets
            out.update({"graph_captures": graphs.num_captures - self.captures[0],
                        "graph_capture_s": round(graphs.capture_seconds - self.captures[1], 3),
                        "graph_capture_warmup_s": round(graphs.capture_warmup_seconds - self.captures[2], 3)})
        profile = rt.pager.stats().profile if rt.pager is not None else None
        moves = tr.page_moves(rt) - self.moves
        out.update({"preemptions": stats.num_preemptions, "memory_short_steps": stats.memory_short_steps,
                    "memory_requests": stats.memory_requests, "memory_offers": stats.memory_offers,
                    "pool_free_bytes_end": rt.pool.free_bytes,
                    "offers_too_small": rt.engine.broker.num_offers_too_small,
                    "raises_dropped": getattr(rt.pager, "num_raises_dropped", 0),
                    "page_moves": moves, "page_moves_per_request": round(moves / num_requests, 3),
                    # A "page move" counted three ways: page_moves are block bit changes; plans are
                    # the planner's answers applied (one lowering of 300 blocks is one); churn counts
                    # distinct blocks and round trips (lowered, then raised again: a copy for nothing).
                    "plans": (rt.pager.num_plans - self.plans) if rt.pager is not None else 0,
                    "churn": profile["churn"] if profile else None,
                    "bytes_copied_host_to_device": profile["bytes_host_to_device"] if profile else 0,
                    "bytes_copied_device_to_device": profile["bytes_device_to_device"] if profile else 0,
                    "pager_profile": profile, "_block_keys": [b.key() for b in rt.table.entries]})
        return out


def write(result: dict, name: str) -> Path:
    return write_result(f"elasticity_{name}", {**result, "traces": {
        t: {p: tr.public(row) for p, row in rows.items()} for t, rows in result["traces"].items()}})


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    run = Run(args)
    counting_triton = args.device.type == "cuda" and tr.count_triton_compiles()
    tr.GC.install()
    result = {"sample_fields": tr.SAMPLE_FIELDS, "code_commit": commit(), "model": run.model.name,
              **run.model.built, "dtype": str(args.dtype), "args": {k: str(v) for k, v in vars(args).items()},
              "bytes": run.sizes, "baseline": "static-8 at the same budget and trace", "traces": {}}
    if args.device.type == "cuda":
        result["triton_compile_hook"] = counting_triton
    warm = True
    for trace, policy in run_order(args.traces, args.policies):
        rows = result["traces"].setdefault(trace, {})
        if time.perf_counter() - started > args.time_limit_s:
            rows[policy] = {"skipped": "time limit"}
            continue
        log(f"{trace} / {policy}")
        rows[policy] = row = run.row(trace, policy, warm)
        warm = False
        if "error" not in row:
            log(f"  {row['output_tokens_per_s']} tok/s, {row['preemptions']} preemptions, "
                f"{row['page_moves']} moves, bits {row['bits_mean_start']}/{row['bits_mean_min']}/"
                f"{row['bits_mean_end']}, back after burst {row['bits_back_after_burst_s']}")
        result["kernel_compiles_process"] = vars(compile_stats())  # precompiles included
        write(result, run.model.name)
    if args.kl:
        for rows in result["traces"].values():
            tr.kl_of_plans(args, rows)
    log(f"wrote {write(result, run.model.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
