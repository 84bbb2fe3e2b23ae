"""A closed-loop trace served by one policy at one memory budget: what bench/elasticity.py and
bench/budget_sweep.py share, written once.

- The model: a paged artifact (`--artifact`) or a real-shape config with random weights
  (`--shape`, offline/real_shape_models.py; `--layers N` keeps N of its layers), with the
  unquantised model beside it where a run serves bf16.
- The budget's parts (`budget_bytes`): non-expert weights, a step's workspace, every expert at
  8 bits and the KV the trace wants (every request's prompt and output at once).
- The trace (`Trace`): requests sent phase by phase, each phase keeping its concurrency in
  flight; random prompts of one length from one seed, EOS ignored, so every run of a trace
  serves the same requests in the same order.
- Per step of a runtime's trace, one sample (SAMPLE_FIELDS) and the bits it served at, so
  the KL to bf16 of the plans served can be scored afterwards (`kl_of_plans`: an artifact
  whose source checkpoint is at hand, CPU).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bench_meta import log
from pagedweight.cli.load_bench import mean_committed_bits
from pagedweight.common.gc_pauses import GCPauses
from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.memory_broker import BrokerConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.runtime import workspace_bytes

# Raise hysteresis of the traces: bytes go back to the weights after half a second of calm
# and only when 4 KV blocks' worth are spare (BrokerConfig says why).
BROKER = BrokerConfig(calm_seconds=0.5, offer_min_blocks=4)
GC = GCPauses()  # the garbage collector's pauses (installed by the caller), in the samples as gc_s
TRITON_COMPILES = [0]  # Triton kernels first met by this process (count_triton_compiles)


def add_args(parser: argparse.ArgumentParser) -> None:
    """The model, the trace's load and the KL scoring: the flags both benchmarks take."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", type=Path, help="paged artifact directory (from pagedweight quantize)")
    what.add_argument("--shape", help="a real-shape config (pagedweight.offline.real_shape_models.CONFIGS; "
                                      "random weights)")
    parser.add_argument("--layers", type=int, default=None, help="--shape: keep this many layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--kl", action="store_true", help="--artifact: KL to bf16 of the plans each run served")
    parser.add_argument("--kl-domain", default="kjv")
    parser.add_argument("--kl-seq-len", type=int, default=128)
    parser.add_argument("--kl-windows", type=int, default=4)
    parser.add_argument("--kl-plans", type=int, default=8, help="most-served plans scored per run")
    parser.add_argument("--time-limit-s", type=float, default=1e9)
    parser.add_argument("--threads", type=int, default=2)


def device_and_dtype(args, parser: argparse.ArgumentParser) -> tuple[torch.device, torch.dtype]:
    if args.kl and not args.artifact:
        parser.error("--kl needs --artifact (the bf16 reference is the artifact's source checkpoint)")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    return device, dtype


@dataclass
class Model:
    paged: object  # the PagedModel every runtime is built from
    config: object  # its ModelConfig
    eos: list[int]
    built: dict  # what was loaded: {"artifact": DIR} or {"shape": NAME, "layers": N}
    bf16: object = None  # the unquantised MoECausalLM of a --shape run, where asked for

    @property
    def name(self) -> str:
        return self.built.get("shape") or Path(self.built["artifact"]).name


def load_model(args, device: torch.device, dtype: torch.dtype, keep_bf16: bool = False) -> Model:
    if args.artifact:
        from pagedweight.format.model_config import read_eos_token_ids
        from pagedweight.format.paged_model import load_paged_model

        paged = load_paged_model(args.artifact, with_bf16=False)
        return Model(paged, paged.config, read_eos_token_ids(args.artifact), {"artifact": str(args.artifact)})
    from pagedweight.format.model_config import ModelConfig
    from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf, paged_in_memory

    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    hf_model, raw = build_hf_model(args.shape, device, dtype, overrides)
    config = ModelConfig.from_dict(raw)
    ours = ours_from_hf(hf_model, config)
    del hf_model
    paged = paged_in_memory(ours, config, raw)
    model = Model(paged, config, config.eos_token_ids, {"shape": args.shape, "layers": config.num_layers},
                  ours if keep_bf16 else None)
    del ours
    free_memory(device)
    return model


def engine_config(args) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=args.concurrency,
                                                  max_num_batched_tokens=args.batched_tokens),
                        kv=KVCacheConfig(), broker=BROKER)


def budget_bytes(model: Model, ecfg: EngineConfig, dtype: torch.dtype, args, kv_fraction: float) -> dict:
    """The budget of non-expert weights, workspace, every expert at 8 bits and `kv_fraction`
    of the KV the trace wants, with its parts."""
    elem = torch.empty((), dtype=dtype).element_size()
    dense = sum(t.numel() for t in model.paged.dense_state.values()) * elem
    workspace = workspace_bytes(model.config, ecfg, dtype)
    experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in model.paged.meta["blocks"])
    wanted = args.concurrency * (args.prompt_len + args.max_tokens) * kv_block_bytes(model.config, 1, dtype)
    return {"budget": int(dense + workspace + experts8 + kv_fraction * wanted), "dense": dense,
            "workspace": workspace, "experts_8bit": experts8, "kv_wanted": wanted,
            "kv_room_at_8bit": int(kv_fraction * wanted),
            "budget_all_kv": int(dense + workspace + experts8 + 1.25 * wanted)}  # block rounding, headroom


def warm_up(engine, prompt_len: int, num_requests: int, runtime=None, buckets: bool = True) -> None:
    """Kernels compiled and caches made before the clock starts: a short load; with `runtime`
    whose bits move, short loads at every width a trace can reach (half the experts lowered to
    b, then all of them) and every block back at its starting bits (the kernels' descriptor
    rows rewritten for them); then every decode bucket once (`warm_decode_buckets`: each new
    attention split count compiles, 0.3-0.5 s a bucket on the H200)."""
    from pagedweight.cli.load_bench import LoadSpec, drive_load
    from pagedweight.engine.graph_warmup import warm_decode_buckets

    drive_load(engine, LoadSpec(num_requests, num_requests, prompt_len, 4, seed=1))
    if runtime is not None and runtime.pager is not None:
        table = runtime.table
        start = table.desired_bits()
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


def free_memory(device: torch.device) -> None:
    """What a closed runtime or a dropped model held, given back before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Phase:
    num_requests: int
    concurrency: int


class Trace:
    """The requests of a closed-loop trace, sent phase by phase: the first phase with requests
    left keeps its concurrency in flight. `burst_end` is when the last request of
    `burst_phase` finished (seconds since the start)."""

    def __init__(self, engine, phases: list[Phase], prompt_len: int, max_tokens: int,
                 burst_phase: int | None = None, seed: int = 0):
        self.engine, self.phases, self.prompt_len, self.burst_phase = engine, phases, prompt_len, burst_phase
        self.gen = torch.Generator().manual_seed(seed)
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.left = [p.num_requests for p in phases]  # requests not sent yet, per phase
        self.num_requests = sum(self.left)
        self.phase_of: dict[str, int] = {}
        self.in_flight: set[str] = set()
        self.sent = self.finished = self.tokens = 0
        self.burst_end = None
        self.start = time.perf_counter()

    def running(self) -> bool:
        return self.sent < self.num_requests or bool(self.in_flight)

    def send(self) -> None:
        vocab = self.engine.model.config.vocab_size
        phase = self._phase()
        while phase is not None and len(self.in_flight) < self.phases[phase].concurrency:
            rid = f"r{self.sent}"
            prompt = torch.randint(1, vocab, (self.prompt_len,), generator=self.gen).tolist()
            self.engine.add_request(rid, prompt, self.params)
            self.in_flight.add(rid)
            self.phase_of[rid] = phase
            self.sent += 1
            self.left[phase] -= 1
            if not self.left[phase]:
                phase = self._phase()

    def received(self, outputs) -> int:
        """Count one step's outputs; returns the tokens it produced."""
        tokens = 0
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.finished:
                self.in_flight.discard(out.request_id)
                self.finished += 1
                if self.phase_of[out.request_id] == self.burst_phase and not self.left[self.burst_phase] and not any(
                        self.phase_of[r] == self.burst_phase for r in self.in_flight):
                    self.burst_end = time.perf_counter() - self.start
        self.tokens += tokens
        return tokens

    def _phase(self) -> int | None:
        return next((i for i, n in enumerate(self.left) if n), None)


def drive_plain(engine, args, time_limit_s: float) -> dict:
    """The steady trace (the same requests as a runtime's) on an engine without a pager:
    tokens/s only. Stops after `time_limit_s` (an engine that preempts and recomputes more than
    it decodes may never finish): the row then says how far it got."""
    trace = Trace(engine, [Phase(args.requests, args.concurrency)], args.prompt_len, args.max_tokens)
    while trace.running() and time.perf_counter() - trace.start < time_limit_s:
        trace.send()
        trace.received(engine.step())
    elapsed = time.perf_counter() - trace.start
    return {"elapsed_s": round(elapsed, 3), "output_tokens": trace.tokens, "requests": args.requests,
            "requests_finished": trace.finished, "output_tokens_per_s": round(trace.tokens / elapsed, 2)}


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


class StepSamples:
    """One row of SAMPLE_FIELDS per step of a runtime's trace, and per committed bit plan the
    tokens served at it (`plans`: key -> [bits, tokens], the input of kl_of_plans)."""

    def __init__(self, runtime, start: float):
        self.runtime, self.start, self.rows = runtime, start, []
        self.cuda = runtime.arena.device.type == "cuda"
        self.plans: dict[bytes, list] = {}
        self.moves, self.key = page_moves(runtime), bits_key(runtime.table)
        self.events, self.device_rows = [], []  # CUDA: per step its events, its allocator and Triton counts
        self.reserved = torch.cuda.memory_reserved() if self.cuda else 0
        self.host_allocs = _host_allocs() if self.cuda else 0
        self.before = None

    def before_step(self) -> None:
        self.before = _step_counters(self.runtime)
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
            self.jit0 = TRITON_COMPILES[0]

    def after_step(self, tokens: int) -> None:
        if self.cuda:
            self.events[-1][1].record()
            reserved, host_allocs = torch.cuda.memory_reserved(), _host_allocs()
            self.device_rows.append([round((reserved - self.reserved) / 2**20, 1), TRITON_COMPILES[0] - self.jit0,
                                     host_allocs - self.host_allocs])
            self.reserved, self.host_allocs = reserved, host_allocs
        moves = page_moves(self.runtime)
        if moves != self.moves:
            self.moves, self.key = moves, bits_key(self.runtime.table)
        self.plans.setdefault(self.key[0], [self.key[1], 0])[1] += tokens
        self.rows.append(self.sample(tokens, self.before))

    def device_spans(self) -> None:
        """Every trace step's stream span (from the host's first launch to its last work done)."""
        if self.cuda:
            torch.cuda.synchronize()
            for row, (a, b), extra in zip(self.rows, self.events, self.device_rows):
                row += [round(a.elapsed_time(b) / 1000, 4), *extra]

    def sample(self, tokens: int, before: tuple | None) -> list:
        """One row of SAMPLE_FIELDS; the step's own seconds where `before` is _step_counters
        taken before it."""
        engine = self.runtime.engine
        row = [round(time.perf_counter() - self.start, 4), round(mean_committed_bits(self.runtime), 4),
               engine.kv.manager.num_used_blocks, len(engine.scheduler.running), len(engine.scheduler.waiting),
               tokens]
        if before is not None:
            row += [round(a - b, 4) for a, b in zip(_step_counters(self.runtime), before)]
        return row


def drive_trace(runtime, phases: list[Phase], prompt_len: int, max_tokens: int, drain_s: float,
                burst_phase: int | None, seed: int = 0) -> dict:
    """Serve the phases, then step idle up to `drain_s` (until the pager is done and the bits
    are back), one sample a step."""
    bits_start = mean_committed_bits(runtime)
    trace = Trace(runtime.engine, phases, prompt_len, max_tokens, burst_phase, seed)
    samples = StepSamples(runtime, trace.start)
    last_report = trace.start
    while trace.running():
        trace.send()
        samples.before_step()
        outputs = runtime.engine.step()
        samples.after_step(trace.received(outputs))
        if time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            log(f"  {trace.finished}/{trace.num_requests} requests, {trace.tokens} tokens, "
                f"mean bits {samples.rows[-1][1]:.3f}")
    elapsed = time.perf_counter() - trace.start
    samples.device_spans()
    drain(runtime, samples, drain_s, bits_start)
    rows, back = samples.rows, None
    if trace.burst_end is not None:
        back = next((t - trace.burst_end for t, b, *_ in rows if t >= trace.burst_end and b >= bits_start - 1e-9),
                    None)
    served = sum(s[1] * s[5] for s in rows) / max(trace.tokens, 1)
    return {"elapsed_s": round(elapsed, 3), "output_tokens": trace.tokens, "requests": trace.num_requests,
            "output_tokens_per_s": round(trace.tokens / elapsed, 2), "bits_mean_start": round(bits_start, 4),
            "bits_mean_min": round(min(s[1] for s in rows), 4), "bits_mean_end": round(rows[-1][1], 4),
            "bits_mean_served": round(served, 4), "burst_end_s": trace.burst_end, "bits_back_after_burst_s": back,
            "samples": rows, "_plans": samples.plans}


def drain(runtime, samples: StepSamples, drain_s: float, bits_start: float) -> None:
    """Idle steps, up to `drain_s`, until the weights have taken their bytes back."""
    start = time.perf_counter()
    while time.perf_counter() - start < drain_s:
        before = _step_counters(runtime)
        runtime.engine.step()
        samples.rows.append(samples.sample(0, before))
        pager_busy = runtime.pager is not None and runtime.pager.busy()
        if not pager_busy and samples.rows[-1][1] >= bits_start - 1e-9:
            break
        if pager_busy:
            time.sleep(0.001)


def page_moves(runtime) -> int:
    """Block bit changes committed so far (a block lowered 8 -> 4 in one plan is one)."""
    c = runtime.mover.counters
    return c.num_lowerings + c.num_raises_committed


def bits_key(table):
    bits = torch.tensor([e.committed_bits for e in table.entries.values()], dtype=torch.int8)
    return bits.numpy().tobytes(), bits


def _step_counters(runtime) -> tuple:
    graphs, phases = runtime.engine.runner.graphs, runtime.engine.phases.seconds
    return (time.perf_counter(), phases["boundary"], graphs.capture_seconds if graphs is not None else 0.0,
            runtime.table.descriptor_seconds, *(phases[p] for p in _OTHER_PHASES), GC.seconds, GC.full_seconds)


def _host_allocs() -> int:
    """Pinned host blocks the caching host allocator has allocated so far (-1: no such stat)."""
    try:
        return int(torch.cuda.host_memory_stats().get("num_host_alloc", -1))
    except (AttributeError, RuntimeError):
        return -1


def count_triton_compiles() -> bool:
    """Count Triton's first compile (or disk-cache load) of each kernel specialisation in this
    process through its post-compile hook: a specialisation first met inside a step is a stall
    the fused kernel's compile counts do not see. False where this Triton has no such hook."""
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


def kl_of_plans(args, rows: dict, scorer=None) -> None:
    """Token-weighted KL(bf16 || served) of the plans each run served (CPU, shared corpus),
    into each row; `scorer`: a quality_budget.Scorer of the artifact to reuse."""
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
                aligned = [0] * len(order)
                for k, b in zip(row["_block_keys"], bits.tolist()):
                    aligned[order[k]] = b
                cache[key] = sc.score(torch.tensor(aligned).numpy(), args.kl_domain, windows)["kl"]
            weighted += cache[key] * tokens
            weight += tokens
        total = sum(t for _, t in plans.values())
        row["kl_served"] = round(weighted / max(weight, 1), 6)
        row["kl_tokens_covered"] = round(weight / max(total, 1), 4)
        row["kl_plans_scored"] = len(top)
        log(f"  KL {name}: {row['kl_served']:.5f} ({row['kl_tokens_covered']:.0%} of tokens)")


def public(row: dict) -> dict:
    """A row without its private fields (plans, block keys: inputs to the KL)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}
