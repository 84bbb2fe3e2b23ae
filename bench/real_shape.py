"""Serving speed at a real model's size, one run: transformers, our engine in bf16, the
runtime at static 8/4/3 bits, and the `pagedweight` policy under memory pressure, each
against the HBM floor measured in the same run.

Nothing is written to disk but the result: the checkpoint is `transformers`' own class
(`Qwen2MoeForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM`, `OlmoeForCausalLM`,
`Gemma4ForCausalLM`) with random bf16 weights drawn on the device, each tensor from a
generator seeded by its name (`--seed`); our `MoECausalLM` is assembled over the same
tensors (no copy); the routed experts are quantised by a fast nested-uniform path
(`nested_uniform_planes`: per-row min-max 8-bit codes, b-bit LUTs at the b-bit bucket
centres; no calibration, so quality is not measured here, but the planes, LUTs and their
byte counts are the real format) into an in-memory `PagedModel` that the runtime is built
from (`build_runtime_from_paged`).

A model whose bf16 weights, KV room and workspace do not fit the device (Mixtral-8x7B on
an 80 GB card) is never built whole (`--build auto`): its artifact is built layer by layer
(`paged_by_layer`: one layer's tensors on the device at a time, the same tensors the whole
build draws), and the sections that need the bf16 model (parity, transformers, the bf16
engine) are marked "does not fit" beside the bf16 floor. `memory` in the JSON has the peak
device and host memory of each section.

Sections, in order of what the device minutes buy (a time limit skips the rest; the JSON
is rewritten after each section, so a cut run still leaves what it measured):
1. copy bandwidth (device-to-device, bytes read + written) -> the HBM floor of every row:
   bytes one decode step must read (non-expert weights, lm_head included, embeddings one
   row per token; the experts the batch touches in expectation under uniform routing,
   E * (1 - (1 - k/E)^B) per layer, at the row's bits) over that bandwidth;
2. parity: our bf16 model's logits against transformers' on one prompt (same tensors);
3. transformers `generate` (bf16, greedy, batch = concurrency);
4. our engine over dense bf16 experts in each of `--modes` (MODES); TTFT of `--ttft-prompts`;
5. the runtime at static-8/4/3 (fused kernel on CUDA), same loads in each mode, TTFT at 4 bits;
6. pressure: budget = 8-bit experts + non-expert weights + workspace + half the KV the load
   wants; `pagedweight` against `static-8` and `static-4`: tokens/s, preemptions, page
   moves, bytes copied, mean bits start/min/end.
Every load reports the graph captures and replays during it (a steady load captures none
once warm); the bf16 engine and every static width have a step profile and a per-component
one (bench/step_components.py).

    python -m bench run real-shape-qwen          # on the GPU (-mixtral, -gemma4, -qwen3, -olmoe)
    python -m bench run real-shape-cpu           # a tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from pathlib import Path

import torch

import pagedweight
from bench.bench_meta import RESULTS_DIR, commit, device_tag, stamp, to_json
from bench.step_components import component_profile, decode_profile
from pagedweight.cli.load_bench import LoadSpec, drive_load, run_load
from pagedweight.engine.decode_graphs import DecodeGraphs
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.offline.host_memory import anonymous_bytes
from pagedweight.offline.real_shape_models import (CONFIGS, GiB, build_hf_model, hf_config_of, ours_from_hf,
                                                  paged_by_layer, paged_in_memory, parity)
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes
from pagedweight_kernels import decode_ops

# How a step runs: every step eager with the batched path's padded gather and the per-expert
# loop over dense experts (the baseline); CUDA-graph replay of every step as token rows,
# prefill chunks included, with the in-place attention and grouped experts (the engine's
# default); then the same with each layer's shared expert on a side stream.
MODES = {
    "eager-gather": dict(attention_impl="batched", graphs=False, grouped=False),
    "graphs-inplace": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True),
    "graphs-overlap": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True, overlap=True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen1.5-moe-a2.7b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-concurrency", type=int, nargs="*", default=None,
                        help="concurrencies of transformers' generate (default: --concurrency)")
    parser.add_argument("--ttft-prompts", type=int, nargs="*", default=[512, 4096])
    parser.add_argument("--static-bits", type=int, nargs="*", default=[4, 8, 3])
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV room of the unpressured runtimes")
    parser.add_argument("--pressure-requests", type=int, default=96)
    parser.add_argument("--pressure-concurrency", type=int, default=64)
    parser.add_argument("--pressure-prompt-len", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["eager-gather", "graphs-inplace"], choices=sorted(MODES),
                        help="how steps run, each measured in the same run (the first is the baseline)")
    parser.add_argument("--profile-concurrency", type=int, nargs="*", default=[1, 64],
                        help="concurrencies of the per-step profile (host phases, device span, kernels)")
    parser.add_argument("--component-concurrency", type=int, nargs="*", default=None,
                        help="concurrencies of the per-component step profile, bf16 and every static width "
                             "(default: --concurrency)")
    parser.add_argument("--build", choices=("auto", "whole", "layers"), default="auto",
                        help="whole: the bf16 model on the device, then quantised; layers: the artifact layer by "
                             "layer, no bf16 model (no parity, transformers or bf16 engine); auto: whole where "
                             "the bf16 weights, KV room and workspace fit the device")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (per tensor name)")
    parser.add_argument("--label", default="", help="what this run measures (e.g. before / after)")
    parser.add_argument("--min-requests", type=int, default=2,
                        help="requests of each load at least (the load has max(this, concurrency))")
    parser.add_argument("--skip", nargs="*", default=[], help="sections to skip: hf bf16 static pressure")
    parser.add_argument("--time-limit-s", type=float, default=540.0)
    parser.add_argument("--reserve-s", type=float, default=60.0,
                        help="time a measurement must have left to start (a runtime build: 30 s more)")
    parser.add_argument("--out", type=Path, default=None, help="result path (default bench/results/)")
    args = parser.parse_args()
    if args.component_concurrency is None:
        args.component_concurrency = args.concurrency
    return args


class Clock:
    """Wall time since the start, against the run's limit."""

    def __init__(self, limit_s: float):
        self.start, self.limit_s = time.perf_counter(), limit_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.limit_s - self.elapsed()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Report:
    """The result file, rewritten after every section."""

    def __init__(self, path: Path, header: dict):
        self.path, self.record = path, header

    def put(self, key: str, value) -> None:
        self.record[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(to_json(self.record) + "\n")
        print(f"[{key}] {json.dumps(value)[:600]}", flush=True)

    def memory(self, section: str, device: torch.device) -> None:
        """The section's peak device memory and the host's anonymous memory after it, under
        "memory" (the peak is reset for the next section)."""
        now = {"host_anon_bytes": anonymous_bytes()}
        if device.type == "cuda":
            now["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
            now["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.reset_peak_memory_stats(device)
        self.put("memory", {**self.record.get("memory", {}), section: now})


# ---------------------------------------------------------------- measuring

def copy_bandwidth(device: torch.device, nbytes: int = 2 * GiB, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the floor's denominator)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


def bf16_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the model's weights in bf16 (counted on the meta device)."""
    from pagedweight.model.transformer import MoECausalLM

    with torch.device("meta"):
        model = MoECausalLM(config)
    tied = model.lm_head.weight.numel() if config.tie_word_embeddings else 0  # one tensor on the device
    return 2 * (sum(p.numel() for p in model.parameters()) - tied)


def decode_bytes(config: ModelConfig, dense_bytes: int, embed_bytes_per_row: int, vocab_rows_bytes: int,
                 batch: int, bits: int | None) -> float:
    """Bytes one decode step of `batch` sequences must read: the non-expert weights once
    (the embedding table only its `batch` rows), the experts the batch touches in
    expectation under uniform routing at `bits` (None: bf16), KV not counted (short here)."""
    E, k, L = config.num_experts, config.num_experts_per_tok, config.num_layers
    H, I = config.hidden_size, config.expert_intermediate_size
    touched = E * (1 - (1 - k / E) ** batch)
    if bits is None:
        per_expert = 2 * (2 * I * H + H * I)
    else:
        per_expert = block_bytes(2 * I, H, bits) + block_bytes(H, I, bits)
    return dense_bytes - vocab_rows_bytes + batch * embed_bytes_per_row + L * touched * per_expert


def graph_counts(engine) -> dict:
    """The engine's graph captures and replays so far, and its steps each way."""
    runner, graphs = engine.runner, engine.runner.graphs
    return {"graph_captures": graphs.num_captures if graphs is not None else 0,
            "graph_replays": graphs.num_replays if graphs is not None else 0,
            "graph_steps": runner.num_graph_steps, "eager_steps": runner.num_eager_steps}


def tokens_per_s(engine, spec: LoadSpec, device: torch.device) -> dict:
    """Output tokens/s of a load after a warm-up load, with the graph captures and replays
    of the measured load (captures there are time the load paid for)."""
    drive_load(engine, LoadSpec(spec.concurrency, spec.concurrency, spec.prompt_len, 4, seed=1))  # warm-up
    sync(device)
    before = graph_counts(engine)
    load = drive_load(engine, spec)
    after = graph_counts(engine)
    return {"concurrency": spec.concurrency, "requests": spec.num_requests, "completed": load.completed,
            "output_tokens": load.output_tokens, "elapsed_s": round(load.elapsed_s, 3),
            "output_tokens_per_s": round(load.output_tokens / load.elapsed_s, 1),
            **{k: after[k] - before[k] for k in after}}


def ttft(engine, prompt_len: int, device: torch.device, repeats: int = 2) -> float:
    """Seconds from add_request to the first token of one prompt on an idle engine (best of n)."""
    vocab = engine.model.config.vocab_size
    best = math.inf
    for r in range(repeats + 1):  # the first one warms up the shapes
        prompt = torch.randint(1, vocab, (prompt_len,), generator=torch.Generator().manual_seed(r)).tolist()
        sync(device)
        t0 = time.perf_counter()
        engine.add_request(f"ttft{prompt_len}-{r}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        done = False
        while not done:
            done = any(out.new_token_ids for out in engine.step())
        elapsed = time.perf_counter() - t0
        if r:
            best = min(best, elapsed)
        while engine.has_work:
            engine.step()
    return round(best, 4)


def prefill_parity(engine, prompt_lens, device: torch.device) -> list[dict]:
    """Every replayed step of a few prompts (each prefilled in one step, then 3 decodes)
    against the same step run eagerly right after it (the varlen batched path; it rewrites
    the same KV slots): relative logit error and argmax agreement (prefill as token rows must
    compute the eager step)."""
    runner = engine.runner
    replay, checked = runner._replay, []

    def replay_and_compare(scheduled):
        replayed = replay(scheduled)
        if replayed is not None:
            logits = replayed[0].float().clone()
            ids, step, rows = runner.prepare(scheduled)
            eager = engine.model.forward_paged(ids, step, rows).float()
            checked.append({"rows": sum(s.num_new_tokens for s in scheduled),
                            "rel_err": float((logits - eager).norm() / eager.norm()),
                            "argmax_agree": float((logits.argmax(-1) == eager.argmax(-1)).float().mean())})
        return replayed

    runner._replay = replay_and_compare
    try:
        vocab = engine.model.config.vocab_size
        gen = torch.Generator().manual_seed(17)
        for i, n in enumerate(prompt_lens):
            engine.add_request(f"parity{i}", torch.randint(1, vocab, (n,), generator=gen).tolist(),
                               SamplingParams(max_tokens=4, ignore_eos=True))
            while engine.has_work:
                engine.step()
        sync(device)
    finally:
        runner._replay = replay
    return checked


def hf_generate_tokens_per_s(hf_model, vocab: int, batch: int, prompt_len: int, new_tokens: int,
                             device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=gen).to(device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf_model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
        elapsed = time.perf_counter() - t0
    produced = batch * (out.shape[1] - prompt_len)
    return {"concurrency": batch, "output_tokens": produced, "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(produced / elapsed, 1)}


def set_mode(engine, mode: str) -> None:
    """Switch a built engine between MODES (no rebuild: the runtime takes 30 s to build)."""
    m = MODES[mode]
    runner = engine.runner
    runner.attention_impl = m["attention_impl"]
    runner.graph_prefill = prefill = m.get("prefill", False)
    engine.model.overlap_shared_experts(m.get("overlap", False))  # before the graphs: captures bake it in
    kwargs = {"max_tokens": engine.graph_tokens()} if prefill else {}
    runner.graphs = DecodeGraphs(engine.model, engine.kv, engine.config.scheduler.max_num_seqs, **kwargs) \
        if m["graphs"] and engine.kv.device.type == "cuda" else None
    for block in engine.model.moe_blocks:
        if hasattr(block.experts, "grouped"):
            block.experts.grouped = m["grouped"]


def engine_config(max_seqs: int, max_tokens: int, num_kv_blocks: int = 1024) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
                        kv=KVCacheConfig(), num_kv_blocks=num_kv_blocks)


# ---------------------------------------------------------------- the run

class Run:
    """The sections of one run, in order, against the clock; each puts its part of the result."""

    def __init__(self, args):
        self.args, self.clock, self.device, self.dtype = args, Clock(args.time_limit_s), torch.device(args.device), \
            torch.bfloat16
        if self.device.type == "cpu":
            torch.set_num_threads(2)
        out = args.out or RESULTS_DIR / f"real_shape_{args.model}_{device_tag()}.json"
        self.report = Report(out, {"benchmark": "real_shape", **stamp(),
                                   "code_commit": os.environ.get("PAGEDWEIGHT_CODE_COMMIT", commit()),
                                   "code_path": str(Path(pagedweight.__file__).parent), "label": args.label,
                                   "model": args.model, "dtype": "bfloat16",
                                   "args": {k: str(v) for k, v in vars(args).items()},
                                   "gemv_max_tokens_per_expert": decode_ops.GEMV_MAX_TOKENS_PER_EXPERT})
        self.specs = [LoadSpec(max(args.min_requests, c), c, args.prompt_len, args.max_tokens)
                      for c in args.concurrency]
        self.max_seqs = max(max(args.concurrency), args.pressure_concurrency)
        self.ecfg = engine_config(self.max_seqs, max(512, min(2048, max(args.ttft_prompts or [0]))))
        _, raw = hf_config_of(args.model)
        self.config = ModelConfig.from_dict(raw)
        self.workspace = workspace_bytes(self.config, self.ecfg, self.dtype)
        self.hf_model = self.ours = self.raw = self.paged = None

    def left(self, more_s: float = 0.0) -> bool:
        """Time left for a measurement (a runtime build needs `more_s` besides)."""
        return self.clock.left() >= self.args.reserve_s + more_s

    def build(self) -> None:
        """The bf16 model on the device (whole), or the paged artifact layer by layer where the
        bf16 model, its KV room and a step's workspace do not fit."""
        args, device, report = self.args, self.device, self.report
        bf16_bytes = bf16_weight_bytes(self.config)
        device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        # the bf16 engine needs its weights, its KV room and a step's workspace at once
        bf16_needs = int(bf16_bytes + args.kv_gib * GiB + self.workspace)
        self.fits = device_bytes is None or bf16_needs <= 0.92 * device_bytes
        self.whole = (args.build if args.build != "auto" else ("whole" if self.fits else "layers")) == "whole"
        report.put("build", {"how": "whole" if self.whole else "layers", "bf16_weight_bytes": bf16_bytes,
                             "bf16_needs_bytes": bf16_needs, "device_bytes": device_bytes, "bf16_fits": self.fits,
                             "seed": args.seed})
        report.memory("start", device)
        t0 = time.perf_counter()
        if self.whole:
            self.hf_model, self.raw = build_hf_model(args.model, device, self.dtype, seed=args.seed)
            sync(device)
            self.ours = ours_from_hf(self.hf_model, self.config)
            report.put("build_s", round(time.perf_counter() - t0, 1))
            report.put("parity_vs_transformers", parity(self.hf_model, self.ours, self.config.vocab_size, device))
            dense = {k: v for k, v in self.ours.state_dict().items() if ".experts." not in k}
        else:
            self.paged, stats = paged_by_layer(args.model, device, self.dtype, args.seed,
                                               log=lambda line: print(line, flush=True))
            report.put("quantize_by_layer", stats)
            report.put("quantize_s", stats["seconds"])
            dense = self.paged.dense_state
            skipped = {"skipped": "does not fit" if not self.fits else "--build layers",
                       "bf16_needs_bytes": bf16_needs, "device_bytes": device_bytes}
            for key in ("parity_vs_transformers", "transformers_generate", "engine_bf16_dense"):
                report.put(key, skipped)
        report.memory("build", device)
        self.dense_bytes = sum(v.numel() * v.element_size() for v in dense.values())
        embed = dense["embed_tokens.weight"]
        self.embed_row_bytes, self.embed_bytes = embed.shape[1] * embed.element_size(), embed.numel() * embed.element_size()

    def floors(self, bandwidth: float) -> None:
        """Per row and concurrency: bytes per decode step and the tokens/s they allow."""
        floors = {}
        for name, bits in [("bf16", None)] + [(f"static-{b}", b) for b in self.args.static_bits]:
            floors[name] = {}
            for c in self.args.concurrency:
                nbytes = decode_bytes(self.config, self.dense_bytes, self.embed_row_bytes, self.embed_bytes, c, bits)
                floors[name][str(c)] = {"bytes_per_step": round(nbytes),
                                        "floor_tokens_per_s": round(c * bandwidth / nbytes, 1)}
            if bits is None and not self.fits:
                floors[name]["does_not_fit"] = True
        self.report.put("hbm_floor", floors)

    def transformers(self) -> None:
        rows = []
        for c in self.args.concurrency if self.args.hf_concurrency is None else self.args.hf_concurrency:
            if not self.left():
                rows.append({"concurrency": c, "skipped": "time limit"})
                continue
            rows.append(hf_generate_tokens_per_s(self.hf_model, self.config.vocab_size, c, self.args.prompt_len,
                                                 self.args.max_tokens, self.device))
            self.report.put("transformers_generate", rows)
        self.report.memory("transformers", self.device)

    def engine_bf16(self) -> None:
        """Our engine over the dense bf16 experts, with KV for every sequence of the largest
        load at once (no preemption in the bf16 rows)."""
        args = self.args
        blocks = -(-5 * max(args.concurrency) * (args.prompt_len + args.max_tokens) // (4 * KVCacheConfig().block_size))
        engine = Engine(self.ours, engine_config(self.max_seqs, self.ecfg.scheduler.max_num_batched_tokens,
                                                 num_kv_blocks=max(1024 if self.device.type == "cuda" else 512,
                                                                   blocks)))
        modes = {}

        def put():
            self.report.put("engine_bf16_dense", modes)

        for mode in args.modes:
            row = modes[mode] = {"loads": []}
            self.mode_loads(engine, mode, row["loads"], put)
            if mode == args.modes[-1]:
                self.profiles(row, engine)
            self.extras(engine, mode, row)
            put()
        del engine
        self.report.memory("engine_bf16", self.device)

    def quantize(self) -> None:
        """The in-memory artifact from the whole bf16 model, which then goes."""
        if self.whole:
            t0 = time.perf_counter()
            self.paged = paged_in_memory(self.ours, self.config, self.raw)
            self.report.put("quantize_s", round(time.perf_counter() - t0, 1))
            self.ours = self.hf_model = None
        self.free_memory()
        self.report.memory("quantize", self.device)
        self.experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in self.paged.meta["blocks"])
        self.report.put("bytes", {"non_expert_weights": self.dense_bytes, "workspace": self.workspace,
                                  "experts_8bit": self.experts8})

    def runtime(self, policy: str, budget: int):
        return build_runtime_from_paged(self.paged, RuntimeConfig(budget, policy, device=str(self.device),
                                                                  dtype=self.dtype, engine=self.ecfg),
                                        self.config.eos_token_ids)

    def static(self, bits_list: list[int]) -> None:
        """The runtime at each static width with ample KV room: every load in each mode, the
        step profiles, and at 4 bits TTFT and the prefill parity per mode."""
        args, static = self.args, self.results.setdefault("runtime_static", {})

        def put():
            self.report.put("runtime_static", static)

        ample = int(self.dense_bytes + self.workspace + self.experts8 + args.kv_gib * GiB)
        for bits in bits_list:
            if not self.left(30):
                static[f"static-{bits}"] = {"skipped": "time limit"}
                continue
            t0 = time.perf_counter()
            rt = self.runtime(f"static-{bits}", ample)
            row = static[f"static-{bits}"] = {"build_s": round(time.perf_counter() - t0, 1), "modes": {}}
            for mode in args.modes:
                loads = row["modes"][mode] = []
                self.mode_loads(rt.engine, mode, loads, put)
                if mode == args.modes[-1]:
                    self.profiles(row, rt.engine)
                if bits == 4:
                    extras = row.setdefault("by_mode", {}).setdefault(mode, {})
                    self.extras(rt.engine, mode, extras)
                    row["ttft_s"] = extras["ttft_s"]
                put()
            put()
            rt.close()
            del rt
            self.free_memory()  # the next runtime's arena is one allocation as large as this one's
            self.report.memory(f"static-{bits}", self.device)

    def pressure(self) -> None:
        """Budget = 8-bit experts + the rest + half the KV the load wants: pagedweight against
        static-4 and static-8 on one closed-loop load (pagedweight.cli.load_bench)."""
        args = self.args
        wanted = args.pressure_concurrency * (args.pressure_prompt_len + args.max_tokens) * kv_block_bytes(
            self.config, 1, self.dtype)
        budget = int(self.dense_bytes + self.workspace + self.experts8 + wanted // 2)
        spec = LoadSpec(args.pressure_requests, args.pressure_concurrency, args.pressure_prompt_len, args.max_tokens)
        pressure = {"budget_bytes": budget, "kv_wanted_bytes": wanted, "kv_room_at_8bit": wanted // 2,
                    "load": vars(spec), "policies": {}}
        for policy in ("static-4", "static-8", "pagedweight"):
            if not self.left(30):
                pressure["policies"][policy] = {"skipped": "time limit"}
                continue
            try:
                rt = self.runtime(policy, budget)
            except Exception as err:  # noqa: BLE001 - a policy that cannot start is a result too
                pressure["policies"][policy] = {"error": repr(err)}
                continue
            result = run_load(rt, spec)
            if rt.pager is not None:
                result["pager"] = rt.pager.stats().to_dict()
            pressure["policies"][policy] = result
            self.report.put("pressure", pressure)
            rt.close()
            del rt
            self.free_memory()
        self.report.put("pressure", pressure)

    def mode_loads(self, engine, mode: str, loads: list, put) -> None:
        set_mode(engine, mode)
        for spec in self.specs:
            if not self.left():
                break
            loads.append(tokens_per_s(engine, spec, self.device))
            put()

    def profiles(self, row: dict, engine) -> None:
        """The step profile and the per-component profile (eager steps)."""
        args = self.args
        row["profile"] = {str(c): decode_profile(engine, c, args.prompt_len, self.device)
                          for c in args.profile_concurrency if self.left(30)}
        row["components"] = {str(c): component_profile(engine, c, args.prompt_len, self.device)
                             for c in args.component_concurrency if self.left(30)}

    def extras(self, engine, mode: str, row: dict) -> None:
        """TTFT and, with prefill graphs, their parity with the eager step."""
        args = self.args
        if MODES[mode].get("prefill") and engine.runner.graph_prefill and self.left():
            row["prefill_parity"] = prefill_parity(engine, sorted({args.prompt_len, 33}), self.device)
        row["ttft_s"] = {str(n): ttft(engine, n, self.device) for n in args.ttft_prompts if self.left()}

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def results(self) -> dict:
        return self.report.record


def main() -> None:
    args = parse_args()
    run = Run(args)
    bandwidth = copy_bandwidth(run.device, GiB // 16 if run.device.type == "cpu" else 2 * GiB)
    run.report.put("copy_bandwidth_bytes_per_s", bandwidth)
    run.build()
    run.floors(bandwidth)
    if run.whole and "hf" not in args.skip:
        run.transformers()
    if run.whole and "bf16" not in args.skip:
        run.engine_bf16()
    run.quantize()
    # 8 and 4 bits first, then the pressure comparison, then 3 bits: what the limit cuts last
    # matters least
    if "static" not in args.skip:
        run.static([b for b in args.static_bits if b != 3])
    if "pressure" not in args.skip:
        run.pressure()
    if "static" not in args.skip:
        run.static([b for b in args.static_bits if b == 3])
    run.report.put("total_s", round(run.clock.elapsed(), 1))
    print(f"wrote {run.report.path}")


if __name__ == "__main__":
    main()
