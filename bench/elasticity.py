"""Precision elasticity under pressure traces (issue 17, point 3): the same trace for every
policy at one memory budget, with what moving the split cost and what it bought.

Policies: `pagedweight` (bits follow the KV pressure), `static-8/4/3` (bits pinned) and
`uniform` (the planner's uniform policy: one bit-width for every block that fits the
budget, re-planned from scratch under pressure). Traces (closed loop, random prompts,
EOS ignored):
- `steady`: a steady overload, `--requests` requests `--concurrency` at a time;
- `burst`: a low load (concurrency `--low`), a burst at `--concurrency`, the low load again,
  then idle: how long after the burst's last request finishes the mean bits take to come
  back to where they started, and page moves per request.
Budget: non-expert weights + workspace + every expert at 8 bits + `--kv-fraction` of the KV
the steady load wants (default half), so static-8 must queue or preempt.

Per policy and trace: output tokens/s, preemptions, steps that waited for KV bytes, page
moves, bytes copied (host->device raises, device->device compaction), mean bits at start /
min / end and served (token-weighted), the pager's profile, and every step's sample
(SAMPLE_FIELDS: mean bits, KV in use, and the step's host seconds in all, at the boundary,
in graph captures and in kernel descriptor rewrites; the bits over time plotted with
--plot). A policy may carry a variant (VARIANTS): `pagedweight:class-launches` (decode
launches follow the bit classes, a capture per change) and `static-8:all-kv` (a budget with
all the KV the load wants: the ceiling of any policy at 8 bits). With `--kl` (a paged artifact from `pagedweight
quantize` whose source checkpoint is at hand, CPU), the quality cost under the trace: the
token-weighted KL(bf16 || served) of the bit plans the trace actually served, scored on the
shared corpus.

The model: `--artifact DIR` (a paged artifact), or `--shape NAME` (offline/real_shape_models.py's
random-weight model at a real size; `--layers N` keeps N layers, to fit the device time).

    PYTHONPATH=.:services:kernels python3 -m bench.elasticity --shape qwen1.5-moe-a2.7b --layers 12
    .venv/bin/python -m bench.elasticity --artifact ART/tiny-qwen-moe --device cpu --kl --plot docs/elasticity_cpu.png
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bench_meta import RESULTS_DIR, commit, device_tag, gpu, machine
from pagedweight.cli.load_bench import mean_committed_bits
from pagedweight.common.gc_pauses import GCPauses, freeze_startup_heap, unfreeze
from pagedweight.engine.memory_broker import BrokerConfig
from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes
from pagedweight_kernels.apl_moe import compile_stats

POLICIES = ("pagedweight", "static-8", "static-4", "static-3", "uniform")
# A policy may carry a variant after a colon: ":class-launches" (decode launches follow the
# layers' bit classes, the behaviour before issue 17's stable launches: a capture per change)
# and ":all-kv" (the budget holds all the KV the load wants: no pressure, the ceiling of any
# policy at those bits), ":compact-while-running" (compaction for raises also while
# sequences run, the behaviour before issue 17 round 6).
VARIANTS = ("class-launches", "all-kv", "compact-while-running")


@dataclass(frozen=True)
class Phase:
    num_requests: int
    concurrency: int


def traces(args) -> dict[str, list[Phase]]:
    return {
        "steady": [Phase(args.requests, args.concurrency)],
        "burst": [Phase(args.low_requests, args.low), Phase(args.requests, args.concurrency),
                  Phase(args.low_requests, args.low)],
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SlowestSteps:
    """cProfile of each step, keeping the `keep` slowest (host functions by cumulative time):
    where a step that stalls spends its host time. Profiling slows every step alike."""

    def __init__(self, keep: int):
        import cProfile

        self.new, self.count = cProfile.Profile, keep
        self.profile, self.kept = self.new(), []  # kept: (seconds, step, text)

    def enable(self):
        self.profile = self.new()
        self.profile.enable()

    def disable(self):
        self.profile.disable()

    def keep(self, step: int, seconds: float):
        import io
        import pstats

        if len(self.kept) >= self.count and seconds <= self.kept[-1][0]:
            return
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats("cumulative").print_stats(25)
        self.kept = sorted(self.kept + [(round(seconds, 4), step, out.getvalue())], reverse=True)[: self.count]


def drive_trace(runtime, phases: list[Phase], prompt_len: int, max_tokens: int, drain_s: float,
                burst_phase: int | None, seed: int = 0, profiler: SlowestSteps | None = None) -> dict:
    """Run the phases, then step idle up to `drain_s` (until the pager is done and the bits
    are back); sample the mean bits every step."""
    engine, table = runtime.engine, runtime.table
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    phase_of: dict[str, int] = {}
    left_in_phase = [p.num_requests for p in phases]
    in_flight: set[str] = set()
    total = sum(p.num_requests for p in phases)
    sent = finished = tokens = 0
    bits_start = mean_committed_bits(runtime)
    samples = []  # [t, mean bits, kv blocks used, running, waiting, tokens this step]
    plans: dict[bytes, list] = {}  # committed bits -> [bits tensor, tokens served at them]
    moves = _moves(runtime)
    key = _bits_key(table)
    burst_end = None
    events = []  # CUDA: (start, end) events around every step, read once the trace is over
    cuda = runtime.arena.device.type == "cuda"
    reserved = torch.cuda.memory_reserved() if cuda else 0
    growth = []  # MiB the caching allocator reserved during each step (a cudaMalloc)
    jits = []  # Triton kernels the process met for the first time in each step (compiled or loaded)
    pinned = []  # pinned host blocks the caching host allocator newly allocated in each step
    host_allocs = _host_allocs() if cuda else 0
    start = time.perf_counter()
    last_report = start
    while sent < total or in_flight:
        phase = next((i for i, n in enumerate(left_in_phase) if n), None)
        while phase is not None and len(in_flight) < phases[phase].concurrency:
            prompt = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
            rid = f"r{sent}"
            engine.add_request(rid, prompt, params)
            in_flight.add(rid)
            phase_of[rid] = phase
            sent += 1
            left_in_phase[phase] -= 1
            if not left_in_phase[phase]:
                phase = next((i for i, n in enumerate(left_in_phase) if n), None)
        step_tokens = 0
        before = _step_counters(runtime)
        if profiler is not None:
            profiler.enable()
        if cuda:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
            jit0 = TRITON_COMPILES[0]
        outputs = engine.step()
        if cuda:
            events[-1][1].record()
            now_reserved = torch.cuda.memory_reserved()
            growth.append(round((now_reserved - reserved) / 2**20, 1))
            reserved = now_reserved
            jits.append(TRITON_COMPILES[0] - jit0)
            now_allocs = _host_allocs()
            pinned.append(now_allocs - host_allocs)
            host_allocs = now_allocs
        if profiler is not None:
            profiler.disable()
            profiler.keep(len(samples), time.perf_counter() - before[0])
        for out in outputs:
            step_tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
                finished += 1
                if phase_of[out.request_id] == burst_phase and not any(
                        phase_of[r] == burst_phase for r in in_flight) and not left_in_phase[burst_phase]:
                    burst_end = time.perf_counter() - start
        tokens += step_tokens
        now_moves = _moves(runtime)
        if now_moves != moves:
            moves, key = now_moves, _bits_key(table)
        plans.setdefault(key[0], [key[1], 0])[1] += step_tokens
        samples.append(_sample(runtime, start, step_tokens, before))
        if time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            log(f"  {finished}/{total} requests, {tokens} tokens, mean bits {samples[-1][1]:.3f}")
    elapsed = time.perf_counter() - start
    if cuda:  # every step's stream span: from the host's first launch to its last work done
        torch.cuda.synchronize()
        for row, (a, b), grew, jit, pins in zip(samples, events, growth, jits, pinned):
            row += [round(a.elapsed_time(b) / 1000, 4), grew, jit, pins]
    drain_start = time.perf_counter()
    while time.perf_counter() - drain_start < drain_s:  # idle: the weights take their bytes back
        before = _step_counters(runtime)
        engine.step()
        samples.append(_sample(runtime, start, 0, before))
        pager_busy = runtime.pager is not None and runtime.pager.busy()
        if not pager_busy and samples[-1][1] >= bits_start - 1e-9:
            break
        if pager_busy:
            time.sleep(0.001)
    back = None
    if burst_end is not None:
        back = next((t - burst_end for t, b, *_ in samples if t >= burst_end and b >= bits_start - 1e-9), None)
    served = sum(s[1] * s[5] for s in samples) / max(tokens, 1)
    return {"elapsed_s": round(elapsed, 3), "output_tokens": tokens, "requests": total,
            "output_tokens_per_s": round(tokens / elapsed, 2), "bits_mean_start": round(bits_start, 4),
            "bits_mean_min": round(min(s[1] for s in samples), 4), "bits_mean_end": round(samples[-1][1], 4),
            "bits_mean_served": round(served, 4), "burst_end_s": burst_end, "bits_back_after_burst_s": back,
            "samples": samples, "_plans": plans}


def run_order(trace_names: list[str], policies: list[str]) -> list[tuple[str, str]]:
    """What a time limit should cut last first: pagedweight against static-8 and static-4
    on every trace, then the other baselines."""
    first = [p for p in ("pagedweight", "static-8", "static-4") if p in policies]
    runs = [(t, p) for t in trace_names for p in first]
    return runs + [(t, p) for t in trace_names for p in policies if p not in first]


def warm_up(runtime, prompt_len: int, buckets: bool = True) -> None:
    """Kernels compiled and caches made before the clock starts: short loads at the
    starting bits and, for a runtime whose bits move, at every bit-width a trace can reach
    (half the experts lowered to b, then all of them), then every block back to its
    starting bits and one more short load (the kernels' descriptor rows rewritten for them).
    Then every decode bucket once (`warm_decode_buckets`: the attention kernel's split
    count follows the batch, and each new one compiled inside the first policy's trace, 0.3-0.5 s
    a bucket on the H200). Every policy gets the same loads, so no run pays another's compiles."""
    from pagedweight.cli.load_bench import LoadSpec, drive_load
    from pagedweight.engine.graph_warmup import warm_decode_buckets

    engine, table = runtime.engine, runtime.table
    start = table.desired_bits()
    drive_load(engine, LoadSpec(16, 16, prompt_len, 4, seed=1))
    if runtime.pager is not None:
        for bits in (7, 6, 5, 4, 3):
            for half in (True, False):
                table.set_desired_bits({b: min(start[b], bits) for b in table.entries if not half or b.expert % 2})
                runtime.mover.step_boundary()
                drive_load(engine, LoadSpec(2, 2, prompt_len, 2, seed=2))
        engine.kv.shrink()
        table.set_desired_bits(start)
        runtime.mover.load_all()
        drive_load(engine, LoadSpec(2, 2, prompt_len, 2, seed=3))
    if buckets:
        warm_decode_buckets(engine)
    engine.kv.shrink()


TRITON_COMPILES = [0]  # Triton kernels first met by this process (count_triton_compiles)
GC = GCPauses()  # the garbage collector's pauses (installed in main), in the samples as gc_s


def _host_allocs() -> int:
    """Pinned host blocks the caching host allocator has allocated so far (-1: no such stat)."""
    try:
        return int(torch.cuda.host_memory_stats().get("num_host_alloc", -1))
    except (AttributeError, RuntimeError):
        return -1


def count_triton_compiles() -> bool:
    """Count Triton's first compile (or disk-cache load) of each kernel specialisation in this
    process through its post-compile hook: a specialisation first met inside a step (a new
    value class of an integer argument, say) is a stall the fused kernel's compile counts do
    not see. False where this Triton has no such hook."""
    try:
        from triton import knobs

        previous = knobs.runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def hook(*args, **kwargs):
        TRITON_COMPILES[0] += 1
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    return True


def warm_trace(config: RuntimeConfig, paged, eos, phases: list[Phase], args, burst_phase) -> None:
    """The first measured row's trace once, on a runtime of its own, discarded: what a process
    pays the first time it meets the trace's shapes (2g: the first policy's mixed prefill
    steps took 0.13-0.15 s where the same policy later in the process took 0.07 s) is then
    paid before every row alike. The runtime is closed after it; each row builds its own."""
    log("warm-up trace (discarded)")
    rt = build_runtime_from_paged(paged, config, eos)
    try:
        warm_up(rt, args.prompt_len, buckets=not args.no_warm_buckets)
        drive_trace(rt, phases, args.prompt_len, args.max_tokens, min(args.drain_s, 2.0), burst_phase)
    finally:
        rt.close()
        del rt
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


SAMPLE_FIELDS = ("t_s", "mean_bits", "kv_blocks_used", "running", "waiting", "tokens",
                 # host seconds of this step: all of it, the step boundary (pager and broker),
                 # decode-graph captures (warm-up included), kernel descriptor rewrites, then
                 # the engine's other phases (engine/step_phases.py: "wait" is the host waiting
                 # for the device to finish the step)
                 "step_s", "boundary_s", "capture_s", "descriptor_s",
                 "schedule_s", "prepare_s", "signature_s", "launch_s", "wait_s", "update_s",
                 # host seconds the garbage collector ran in the step (any phase), and of them in
                 # full collections (common/gc_pauses.py)
                 "gc_s", "gc_full_s",
                 # CUDA, steps of the trace (not the drain): seconds between events recorded on
                 # the compute stream before and after the step (device work and the gaps the
                 # host left in it), MiB the caching allocator newly reserved in the step, and
                 # Triton kernels the process met for the first time in it (TRITON_COMPILES),
                 # pinned host blocks newly allocated in it (cudaHostAlloc, -1: not counted)
                 "stream_s", "alloc_growth_mib", "triton_compiles", "host_pinned_allocs")
_OTHER_PHASES = ("schedule", "prepare", "signature", "launch", "wait", "update")


def _step_counters(runtime) -> tuple:
    graphs, phases = runtime.engine.runner.graphs, runtime.engine.phases.seconds
    return (time.perf_counter(), phases["boundary"], graphs.capture_seconds if graphs is not None else 0.0,
            runtime.table.descriptor_seconds, *(phases[p] for p in _OTHER_PHASES), GC.seconds, GC.full_seconds)


def _sample(runtime, start: float, tokens: int, before: tuple | None = None) -> list:
    """One row of SAMPLE_FIELDS; the step's own seconds when `before` is _step_counters
    taken before it."""
    engine = runtime.engine
    row = [round(time.perf_counter() - start, 4), round(mean_committed_bits(runtime), 4),
           engine.kv.manager.num_used_blocks, len(engine.scheduler.running), len(engine.scheduler.waiting), tokens]
    if before is not None:
        row += [round(a - b, 4) for a, b in zip(_step_counters(runtime), before)]
    return row


def _moves(runtime) -> int:
    c = runtime.mover.counters
    return c.num_lowerings + c.num_raises_committed


def _bits_key(table):
    bits = torch.tensor([e.committed_bits for e in table.entries.values()], dtype=torch.int8)
    return bits.numpy().tobytes(), bits


def engine_config(args) -> EngineConfig:
    broker = BrokerConfig(calm_steps=args.calm_steps, calm_seconds=args.calm_seconds,
                          offer_min_blocks=args.offer_min_blocks, ask_ahead_blocks=args.ask_ahead_blocks,
                          offer_min_used_fraction=args.offer_min_used_fraction,
                          project_demand=not args.no_project_demand, ask_before_short=not args.no_ask_before_short)
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=args.concurrency,
                                                  max_num_batched_tokens=args.batched_tokens),
                        kv=KVCacheConfig(), broker=broker, graphs_per_bucket=args.graphs_per_bucket)


def load_model(args, device: torch.device, dtype: torch.dtype):
    """(paged model, its config, eos ids, what was built)."""
    if args.artifact:
        from pagedweight.format.model_config import read_eos_token_ids
        from pagedweight.format.paged_model import load_paged_model

        paged = load_paged_model(args.artifact, with_bf16=False)
        return paged, paged.config, read_eos_token_ids(args.artifact), {"artifact": str(args.artifact)}
    from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf, paged_in_memory
    from pagedweight.format.model_config import ModelConfig

    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    hf_model, raw = build_hf_model(args.shape, device, dtype, overrides)
    config = ModelConfig.from_dict(raw)
    paged = paged_in_memory(ours_from_hf(hf_model, config), config, raw)
    del hf_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return paged, config, config.eos_token_ids, {"shape": args.shape, "layers": config.num_layers}


def budget_bytes(paged, config, ecfg: EngineConfig, dtype: torch.dtype, args) -> dict:
    elem = torch.empty((), dtype=dtype).element_size()
    dense = sum(t.numel() for t in paged.dense_state.values()) * elem
    workspace = workspace_bytes(config, ecfg, dtype)
    experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in paged.meta["blocks"])
    wanted = args.concurrency * (args.prompt_len + args.max_tokens) * kv_block_bytes(config, 1, dtype)
    return {"budget": int(dense + workspace + experts8 + args.kv_fraction * wanted), "dense": dense,
            "workspace": workspace, "experts_8bit": experts8, "kv_wanted": wanted,
            "kv_room_at_8bit": int(args.kv_fraction * wanted),
            "budget_all_kv": int(dense + workspace + experts8 + 1.25 * wanted)}  # block rounding, headroom


def kl_of_plans(args, rows: dict, scorer=None) -> None:
    """Token-weighted KL(bf16 || served) of the plans each run served (CPU, shared corpus);
    `scorer`: a quality_budget.Scorer of the artifact to reuse (None: one is built)."""
    from bench.quality_budget import Scorer, windows_of
    from pagedweight.common.paths import corpus_dir

    sc = scorer or Scorer(Path(args.artifact))
    ids = sc.tokenizer.encode((corpus_dir() / f"{args.kl_domain}.valid.txt").read_text())
    windows = windows_of(ids, args.kl_seq_len, args.kl_windows)
    order = {b.key(): i for i, b in enumerate(sc.table.block_ids)}
    cache: dict[bytes, float] = {}
    for name, row in rows.items():
        plans = row.pop("_plans", None)
        if not plans:
            continue
        top = sorted(plans.items(), key=lambda kv: -kv[1][1])[: args.kl_plans]
        weighted = weight = 0.0
        for key, (bits, tokens) in top:
            if key not in cache:
                keys = row["_block_keys"]
                aligned = [0] * len(order)
                for k, b in zip(keys, bits.tolist()):
                    aligned[order[k]] = b
                cache[key] = sc.score(torch.tensor(aligned).numpy(), args.kl_domain, windows)["kl"]
            weighted += cache[key] * tokens
            weight += tokens
        total = sum(t for _, t in plans.values())
        row["kl_served"] = round(weighted / max(weight, 1), 6)
        row["kl_tokens_covered"] = round(weight / max(total, 1), 4)
        row["kl_plans_scored"] = len(top)
        log(f"  KL {name}: {row['kl_served']:.5f} ({row['kl_tokens_covered']:.0%} of tokens)")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["traces"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, trace in zip(axes[0], names):
        for policy, row in result["traces"][trace].items():
            if "samples" not in row:
                continue
            t = [s[0] for s in row["samples"]]
            ax.plot(t, [s[1] for s in row["samples"]], label=f"{policy} ({row['output_tokens_per_s']:.0f} tok/s)")
            if row.get("burst_end_s") is not None and policy == "pagedweight":
                ax.axvline(row["burst_end_s"], color="grey", linestyle=":", label="burst ends")
        ax.set_title(f"{trace}: mean expert bits over time")
        ax.set_xlabel("seconds")
        ax.set_ylabel("mean committed bits")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} - budget {result['bytes']['budget'] / 2**30:.2f} GiB, {result['machine']}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", type=Path, help="paged artifact directory")
    what.add_argument("--shape", help="a real-shape config (pagedweight.offline.real_shape_models.CONFIGS; random weights)")
    parser.add_argument("--layers", type=int, default=None, help="--shape: keep this many layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--traces", nargs="+", default=["steady", "burst"])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--low", type=int, default=8, help="burst trace: concurrency before and after")
    parser.add_argument("--low-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-fraction", type=float, default=0.5, help="KV room at 8 bits / KV the load wants")
    parser.add_argument("--calm-steps", type=int, default=16)
    parser.add_argument("--calm-seconds", type=float, default=0.5)
    parser.add_argument("--offer-min-blocks", type=int, default=4)
    parser.add_argument("--ask-ahead-blocks", type=int, default=0)
    parser.add_argument("--no-project-demand", action="store_true",
                        help="the broker asks for this step's shortage only and offers every spare byte "
                             "(the behaviour before issue 17's projected demand, for comparison)")
    parser.add_argument("--no-ask-before-short", action="store_true",
                        help="the broker asks for the projected demand only at the first shortage "
                             "(the behaviour before issue 17 round 6)")
    parser.add_argument("--move-cost", type=float, default=RuntimeConfig.move_cost,
                        help="pagedweight: cost of each moved block in a lowering plan, in medians of one "
                             "bit's damage (fewer blocks lowered further); 0: the one-bit greedy")
    parser.add_argument("--drain-s", type=float, default=12.0)
    parser.add_argument("--graphs-per-bucket", type=int, default=1,
                        help="decode graphs kept per batch bucket, one per bit-class signature")
    parser.add_argument("--no-precompile", action="store_true",
                        help="compile fused-kernel instances on first use instead of at start-up "
                             "(the behaviour before issue 17's precompile, for comparison)")
    parser.add_argument("--no-warm-buckets", action="store_true",
                        help="do not meet every decode bucket before the clock starts (the behaviour "
                             "before issue 17's bucket warm-up: the first policy compiles them in its trace)")
    parser.add_argument("--stable-launches", choices=("auto", "on", "off"), default="auto",
                        help="decode launches independent of the layers' bits (auto: for moving policies)")
    parser.add_argument("--offer-min-used-fraction", type=float, default=BrokerConfig.offer_min_used_fraction,
                        help="spare bytes are offered back only when at least this fraction of the KV in use")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the start-up heap in the garbage collector (a full collection then walks it "
                             "inside the trace, the behaviour before issue 17 round 6)")
    parser.add_argument("--no-warm-trace", action="store_true",
                        help="do not run the first (trace, policy) once, discarded, before the first measured "
                             "row (process-wide first-run costs then land in the first row)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="cProfile every step and keep the host profile of this many slowest (slows all steps)")
    parser.add_argument("--kl", action="store_true", help="--artifact: KL to bf16 of the plans served")
    parser.add_argument("--kl-domain", default="kjv")
    parser.add_argument("--kl-seq-len", type=int, default=128)
    parser.add_argument("--kl-windows", type=int, default=4)
    parser.add_argument("--kl-plans", type=int, default=8, help="most-served plans scored per run")
    parser.add_argument("--time-limit-s", type=float, default=1e9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.kl and not args.artifact:
        parser.error("--kl needs --artifact (the bf16 reference is the artifact's source checkpoint)")
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    paged, config, eos, built = load_model(args, device, dtype)
    counting_triton = device.type == "cuda" and count_triton_compiles()
    GC.install()
    ecfg = engine_config(args)
    sizes = budget_bytes(paged, config, ecfg, dtype, args)
    name = built.get("shape") or Path(args.artifact).name
    out = args.out or RESULTS_DIR / f"elasticity_{name}_{device_tag()}.json"
    result = {"benchmark": "elasticity", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "sample_fields": SAMPLE_FIELDS,
              "machine": machine(), "commit": commit(), "gpu": gpu(), "code_commit": commit(), "model": name, **built,
              "dtype": str(dtype),
              "args": {k: str(v) for k, v in vars(args).items()}, "bytes": sizes,
              "baseline": "static-8 at the same budget and trace", "traces": {}}
    if device.type == "cuda":
        result["triton_compile_hook"] = counting_triton
    all_traces = traces(args)
    warmed_process = False
    for trace, policy in run_order(args.traces, args.policies):
        phases = all_traces[trace]
        burst_phase = 1 if trace == "burst" else None
        rows = result["traces"].setdefault(trace, {})
        if time.perf_counter() - started > args.time_limit_s:
            rows[policy] = {"skipped": "time limit"}
            continue
        log(f"{trace} / {policy}")
        base, _, variant = policy.partition(":")
        if variant and variant not in VARIANTS:
            parser.error(f"policy {policy!r}: the variants are {VARIANTS}")
        stable = {"class-launches": False}.get(variant, None if args.stable_launches == "auto"
                                                else args.stable_launches == "on")
        budget = sizes["budget_all_kv"] if variant == "all-kv" else sizes["budget"]
        config = RuntimeConfig(budget, base, device=str(device), dtype=dtype, engine=ecfg, move_cost=args.move_cost,
                               precompile_kernels=not args.no_precompile, stable_decode_launches=stable,
                               compact_raises_while_running=variant == "compact-while-running")
        try:
            if not warmed_process:
                warmed_process = True
                if not args.no_warm_trace:
                    warm_trace(config, paged, eos, phases, args, burst_phase)
            rt = build_runtime_from_paged(paged, config, eos)
        except Exception as err:  # noqa: BLE001 - a policy that cannot start is a result too
            rows[policy] = {"error": repr(err)}
            log(f"  {policy}: {err!r}")
            continue
        warm_up(rt, args.prompt_len, buckets=not args.no_warm_buckets)
        if not args.no_gc_freeze:  # as the worker does once warmed up (worker/server.py)
            freeze_startup_heap()
        gc0 = (GC.seconds, GC.full_seconds, GC.num_full)
        rt.table.num_descriptor_updates, rt.table.descriptor_seconds = 0, 0.0  # the trace's own
        if rt.pager is not None:
            rt.pager.mover.profile.reset()
        moves0, plans0 = _moves(rt), rt.pager.num_plans if rt.pager is not None else 0
        graphs = rt.engine.runner.graphs  # None: decode steps run eagerly (CPU)
        captures0 = (graphs.num_captures, graphs.capture_seconds, graphs.capture_warmup_seconds) \
            if graphs is not None else (0, 0.0, 0.0)
        compiles0 = compile_stats()
        profiler = SlowestSteps(args.profile_steps) if args.profile_steps else None
        row = drive_trace(rt, phases, args.prompt_len, args.max_tokens, args.drain_s, burst_phase, profiler=profiler)
        if profiler is not None:
            row["slowest_steps"] = [{"step": i, "seconds": t, "profile": text} for t, i, text in profiler.kept]
        compiles = compile_stats()  # fused-kernel instances first met inside the trace (0 after precompile)
        row.update({"gc_s": round(GC.seconds - gc0[0], 4), "gc_full_s": round(GC.full_seconds - gc0[1], 4),
                    "gc_full_collections": GC.num_full - gc0[2]})
        row.update({"kernel_compiles": compiles.count - compiles0.count,
                    "kernel_compile_s": round(compiles.seconds - compiles0.seconds, 3)})
        if graphs is not None:  # a bit-class change in any layer re-captures each bucket it meets
            row.update({"graph_captures": graphs.num_captures - captures0[0],
                        "graph_capture_s": round(graphs.capture_seconds - captures0[1], 3),
                        "graph_capture_warmup_s": round(graphs.capture_warmup_seconds - captures0[2], 3)})
        stats = rt.engine.stats()
        profile = rt.pager.stats().profile if rt.pager is not None else None
        row.update({"preemptions": stats.num_preemptions, "memory_short_steps": stats.memory_short_steps,
                    "memory_requests": stats.memory_requests, "memory_offers": stats.memory_offers,
                    "pool_free_bytes_end": rt.pool.free_bytes,
                    "offers_too_small": rt.engine.broker.num_offers_too_small,
                    "raises_dropped": getattr(rt.pager, "num_raises_dropped", 0),
                    "page_moves": _moves(rt) - moves0,
                    "page_moves_per_request": round((_moves(rt) - moves0) / row["requests"], 3),
                    # What a "page move" is, counted three ways: page_moves above are block bit
                    # changes (a block lowered 8 -> 4 in one plan is one); plans are the planner's
                    # answers applied (one lowering of 300 blocks is one); churn counts distinct
                    # blocks and round trips (lowered, then raised again: a copy for nothing).
                    "plans": (rt.pager.num_plans - plans0) if rt.pager is not None else 0,
                    "churn": profile["churn"] if profile else None,
                    "bytes_copied_host_to_device": profile["bytes_host_to_device"] if profile else 0,
                    "bytes_copied_device_to_device": profile["bytes_device_to_device"] if profile else 0,
                    "pager_profile": profile, "_block_keys": [b.key() for b in rt.table.entries]})
        rows[policy] = row
        log(f"  {row['output_tokens_per_s']} tok/s, {row['preemptions']} preemptions, "
            f"{row['page_moves']} moves, bits {row['bits_mean_start']}/{row['bits_mean_min']}/"
            f"{row['bits_mean_end']}, back after burst {row['bits_back_after_burst_s']}")
        rt.close()
        del rt
        unfreeze()  # the runtime's objects: collectable again
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["kernel_compiles_process"] = vars(compile_stats())  # precompiles included
        _write(out, result)
    if args.kl:
        for rows in result["traces"].values():
            kl_of_plans(args, rows)
    _write(out, result)
    if args.plot:
        plot(result, args.plot)
    log(f"wrote {out}")
    return 0


def _write(path: Path, result: dict) -> None:
    clean = {**result, "traces": {t: {p: {k: v for k, v in row.items() if not k.startswith("_")}
                                      for p, row in rows.items()} for t, rows in result["traces"].items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(compact_json(clean))


def compact_json(result: dict) -> str:
    """One line per top-level key and one per (trace, policy) row, so diffs stay readable."""
    one = lambda v: json.dumps(v, separators=(",", ":"))
    lines = []
    for key, value in result.items():
        if key != "traces":
            lines.append(f" {json.dumps(key)}: {one(value)}")
            continue
        traces = [f"  {json.dumps(t)}: {{\n" + ",\n".join(f"   {json.dumps(p)}: {one(row)}" for p, row in rows.items())
                  + "\n  }" for t, rows in value.items()]
        lines.append(' "traces": {\n' + ",\n".join(traces) + "\n }")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    sys.exit(main())
