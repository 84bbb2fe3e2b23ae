"""Serving speed at a real model's size, one run on one GPU (docs/real_shape.md): transformers,
our engine in bf16, the runtime at static widths and the `pagedweight` policy under memory
pressure, each against the HBM floor of the same run (bytes a decode step reads over the copy
bandwidth); under pressure also each policy's logit error against bf16 at the bits it served.
Sections run in order of what the device minutes buy; a time limit skips the rest, and the
JSON is rewritten after each, so a cut run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench.bench_meta import RESULTS_DIR, device_tag, free_memory, stamp, to_json
from bench.logit_probe import LogitProbe, replay_with_probes
from bench.step_components import component_profile, decode_profile, sync
from pagedweight.cli.load_bench import LoadSpec, drive_load, mean_committed_bits, run_load
from pagedweight.engine.decode_graphs import DecodeGraphs
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.offline.real_shape_models import (CONFIGS, GiB, build_hf_model, hf_config_of, ours_from_hf,
                                                  paged_by_layer, paged_in_memory, parity)
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes

# How a step runs: eager with the padded gather and a per-expert loop (the baseline); CUDA-graph
# replay of every step, prefill chunks included, in-place attention and grouped experts (the
# engine's default); the same with each layer's shared expert on a side stream.
MODES = {
    "eager-gather": dict(attention_impl="batched", graphs=False, grouped=False),
    "graphs-inplace": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True),
    "graphs-overlap": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True, overlap=True),
}
# the pressure section's load: 96 requests of 256-token prompts, 64 at a time
PRESSURE = dict(num_requests=96, concurrency=64, prompt_len=256)
PROMPT_LEN, MAX_TOKENS = 32, 64  # the loads' requests
PROBES = 6  # logit probes of a pressure replay at regular steps (besides its start and new lows of bits)
RESERVE_S = 60.0  # time a measurement must have left to start (a runtime build: 30 s more)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen1.5-moe-a2.7b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hf-concurrency", type=int, nargs="*", default=None,
                        help="concurrencies of transformers' generate (default: --concurrency)")
    parser.add_argument("--ttft-prompts", type=int, nargs="*", default=[512, 4096])
    parser.add_argument("--static-bits", type=int, nargs="*", default=[4, 8, 3])
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV room of the unpressured runtimes")
    parser.add_argument("--modes", nargs="+", default=["eager-gather", "graphs-inplace"], choices=sorted(MODES),
                        help="how steps run, each measured in the same run (the first is the baseline)")
    parser.add_argument("--profile-concurrency", type=int, nargs="*", default=[1, 64],
                        help="concurrencies of the per-step profile (host phases, kernels)")
    parser.add_argument("--component-concurrency", type=int, nargs="*", default=None,
                        help="concurrencies of the per-component step profile, bf16 and every static width "
                             "(default: --concurrency)")
    parser.add_argument("--build", choices=("auto", "whole", "layers"), default="auto",
                        help="whole: the bf16 model on the device, then quantised; layers: the artifact layer by "
                             "layer, no bf16 model (no parity, transformers or bf16 engine); auto: whole where "
                             "the bf16 weights, KV room and workspace fit the device")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (per tensor name)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("hf", "pressure"), help="sections to skip")
    parser.add_argument("--time-limit-s", type=float, default=540.0)
    args = parser.parse_args()
    if args.component_concurrency is None:
        args.component_concurrency = args.concurrency
    return args


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the floor's denominator)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times[1:])[repeats // 2]


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
    per_expert = 2 * 3 * I * H if bits is None else block_bytes(2 * I, H, bits) + block_bytes(H, I, bits)
    return dense_bytes - vocab_rows_bytes + batch * embed_bytes_per_row + L * touched * per_expert


def graph_counts(engine) -> dict:
    """The engine's graph captures and replays so far, and its steps each way."""
    runner, graphs = engine.runner, engine.runner.graphs
    return {"graph_captures": graphs.num_captures if graphs is not None else 0,
            "graph_replays": graphs.num_replays if graphs is not None else 0,
            "graph_steps": runner.num_graph_steps, "eager_steps": runner.num_eager_steps}


def tokens_per_s(engine, spec: LoadSpec, device: torch.device) -> dict:
    """Output tokens/s of a load after a warm-up load, with the graph captures and replays
    of the measured load (captures there are time the load paid for). The warm-up's requests
    run until the last prompt's prefill chunk is done and every sequence decodes at once, so
    it meets the decode buckets the measured load meets (with 4 new tokens the first chunks'
    sequences finished before the last chunk ran, and the full batch's bucket was captured
    inside the measured load)."""
    prefill_steps = -(-spec.concurrency * spec.prompt_len // engine.config.scheduler.max_num_batched_tokens)
    drive_load(engine, LoadSpec(spec.concurrency, spec.concurrency, spec.prompt_len, max(4, prefill_steps + 2), seed=1))
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
        while not any(out.new_token_ids for out in engine.step()):
            pass
        if r:
            best = min(best, time.perf_counter() - t0)
        while engine.has_work:
            engine.step()
    return round(best, 4)


def hf_generate_tokens_per_s(hf_model, vocab: int, batch: int, prompt_len: int, new_tokens: int,
                             device: torch.device) -> dict:
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
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
    m, runner = MODES[mode], engine.runner
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


class Run:
    """The sections of one run, in order, against the clock; each puts its part of the result."""

    def __init__(self, args):
        self.args, self.started, self.device, self.dtype = args, time.perf_counter(), torch.device(args.device), \
            torch.bfloat16
        if self.device.type == "cpu":
            torch.set_num_threads(2)
        self.path = RESULTS_DIR / f"real_shape_{args.model}_{device_tag()}.json"
        self.record = {"benchmark": "real_shape", **stamp(), "model": args.model, "dtype": "bfloat16",
                       "args": {k: str(v) for k, v in vars(args).items()}}
        self.specs = [LoadSpec(max(2, c), c, PROMPT_LEN, MAX_TOKENS) for c in args.concurrency]
        self.max_seqs = max(*args.concurrency, PRESSURE["concurrency"])
        self.ecfg = engine_config(self.max_seqs, max(512, min(2048, max(args.ttft_prompts or [0]))))
        self.config = ModelConfig.from_dict(hf_config_of(args.model)[1])
        self.workspace = workspace_bytes(self.config, self.ecfg, self.dtype)
        self.hf_model = self.ours = self.raw = self.paged = None
        self.probe: LogitProbe | None = None  # the pressure rows' bf16 reference (whole builds only)

    def put(self, key: str, value) -> None:
        """One part of the result; the file is rewritten (a cut run keeps what it measured)."""
        self.record[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(to_json(self.record) + "\n")
        print(f"[{key}] {json.dumps(value)[:600]}", flush=True)

    def left(self, more_s: float = 0.0) -> bool:
        """Time left for a measurement (a runtime build needs `more_s` besides)."""
        return self.args.time_limit_s - (time.perf_counter() - self.started) >= RESERVE_S + more_s

    def build(self) -> None:
        """The bf16 model on the device (whole), or the paged artifact layer by layer where the
        bf16 model, its KV room and a step's workspace do not fit."""
        args, device = self.args, self.device
        bf16_bytes = bf16_weight_bytes(self.config)
        device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        bf16_needs = int(bf16_bytes + args.kv_gib * GiB + self.workspace)  # weights, KV room, a step's workspace
        self.fits = device_bytes is None or bf16_needs <= 0.92 * device_bytes
        self.whole = (args.build if args.build != "auto" else ("whole" if self.fits else "layers")) == "whole"
        self.put("build", {"how": "whole" if self.whole else "layers", "bf16_weight_bytes": bf16_bytes,
                           "bf16_needs_bytes": bf16_needs, "device_bytes": device_bytes, "bf16_fits": self.fits,
                           "seed": args.seed})
        t0 = time.perf_counter()
        if self.whole:
            self.hf_model, self.raw = build_hf_model(args.model, device, self.dtype, seed=args.seed)
            self.ours = ours_from_hf(self.hf_model, self.config)
            self.put("build_s", round(time.perf_counter() - t0, 1))
            self.put("parity_vs_transformers", parity(self.hf_model, self.ours, self.config.vocab_size, device))
            dense = {k: v for k, v in self.ours.state_dict().items() if ".experts." not in k}
        else:
            self.paged, stats = paged_by_layer(args.model, device, self.dtype, args.seed,
                                               log=lambda line: print(line, flush=True))
            self.put("quantize_by_layer", stats)
            dense = self.paged.dense_state
            skipped = {"skipped": "does not fit" if not self.fits else "--build layers",
                       "bf16_needs_bytes": bf16_needs, "device_bytes": device_bytes}
            for key in ("parity_vs_transformers", "transformers_generate", "engine_bf16_dense"):
                self.put(key, skipped)
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
        self.put("hbm_floor", floors)

    def transformers(self) -> None:
        rows = []
        for c in self.args.concurrency if self.args.hf_concurrency is None else self.args.hf_concurrency:
            rows.append(hf_generate_tokens_per_s(self.hf_model, self.config.vocab_size, c, PROMPT_LEN,
                                                 MAX_TOKENS, self.device) if self.left()
                        else {"concurrency": c, "skipped": "time limit"})
            self.put("transformers_generate", rows)

    def engine_bf16(self) -> None:
        """Our engine over the dense bf16 experts, with KV for every sequence of the largest
        load at once (no preemption in the bf16 rows)."""
        args = self.args
        blocks = -(-5 * max(args.concurrency) * (PROMPT_LEN + MAX_TOKENS) // (4 * KVCacheConfig().block_size))
        engine = Engine(self.ours, engine_config(self.max_seqs, self.ecfg.scheduler.max_num_batched_tokens,
                                                 max(1024 if self.device.type == "cuda" else 512, blocks)))
        modes = {}
        for mode in args.modes:
            row = modes[mode] = {"loads": []}
            self.measure_mode(engine, mode, row, row["loads"], lambda: self.put("engine_bf16_dense", modes), row)
        del engine

    def quantize(self) -> None:
        """The in-memory artifact from the whole bf16 model, which then goes (the pressure
        section's logit probe keeps its bf16 logits)."""
        if self.whole:
            t0 = time.perf_counter()
            self.paged = paged_in_memory(self.ours, self.config, self.raw)
            self.put("quantize_s", round(time.perf_counter() - t0, 1))
            if "pressure" not in self.args.skip:
                self.probe = LogitProbe.of(self.ours)
            self.ours = self.hf_model = None
        free_memory(self.device)
        self.experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in self.paged.meta["blocks"])
        self.put("bytes", {"non_expert_weights": self.dense_bytes, "workspace": self.workspace,
                           "experts_8bit": self.experts8})

    def runtime(self, policy: str, budget: int):
        return build_runtime_from_paged(self.paged, RuntimeConfig(budget, policy, device=str(self.device),
                                                                  dtype=self.dtype, engine=self.ecfg),
                                        self.config.eos_token_ids)

    def static(self, bits_list: list[int]) -> None:
        """The runtime at each static width with ample KV room: every load in each mode, the
        step profiles, and at 4 bits TTFT per mode."""
        static = self.record.setdefault("runtime_static", {})
        ample = int(self.dense_bytes + self.workspace + self.experts8 + self.args.kv_gib * GiB)
        for bits in bits_list:
            if not self.left(30):
                static[f"static-{bits}"] = {"skipped": "time limit"}
                continue
            t0 = time.perf_counter()
            rt = self.runtime(f"static-{bits}", ample)
            row = static[f"static-{bits}"] = {"build_s": round(time.perf_counter() - t0, 1), "modes": {}}
            for mode in self.args.modes:
                extras = row.setdefault("by_mode", {}).setdefault(mode, {}) if bits == 4 else None
                self.measure_mode(rt.engine, mode, row, row["modes"].setdefault(mode, []),
                                  lambda: self.put("runtime_static", static), extras)
                if extras is not None:
                    row["ttft_s"] = extras["ttft_s"]
            self.put("runtime_static", static)
            rt.close()
            del rt
            free_memory(self.device)  # the next runtime's arena is one allocation as large as this one's

    def pressure(self) -> None:
        """Budget = 8-bit experts + the rest + half the KV the load wants: pagedweight against
        static-4 and static-8 on one closed-loop load (pagedweight.cli.load_bench), then each
        policy's logit error against bf16 in a replay (served_error)."""
        spec = LoadSpec(**PRESSURE, max_tokens=MAX_TOKENS)
        wanted = spec.concurrency * (spec.prompt_len + spec.max_tokens) * kv_block_bytes(self.config, 1, self.dtype)
        budget = int(self.dense_bytes + self.workspace + self.experts8 + wanted // 2)
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
            pressure["policies"][policy] = result = run_load(rt, spec)
            if rt.pager is not None:
                result["pager"] = rt.pager.stats().to_dict()
            result["served_logit_error"] = self.served_error(rt, spec, result["steps"] - result["drain_steps"])
            self.put("pressure", pressure)
            rt.close()
            del rt
            free_memory(self.device)
        self.put("pressure", pressure)

    def served_error(self, rt, spec: LoadSpec, num_steps: int) -> dict:
        """The logit probe against bf16 at about PROBES steps of a replay of the measured load
        of `num_steps` steps (bench/logit_probe.py says why a replay)."""
        if self.probe is None:
            return {"skipped": "no bf16 reference: " + ("does not fit" if not self.fits else "--build layers")}
        if not self.left():
            return {"skipped": "time limit"}
        return replay_with_probes(rt.engine, spec, self.probe, lambda: mean_committed_bits(rt),
                                  every=max(1, num_steps // PROBES))

    def measure_mode(self, engine, mode: str, row: dict, loads: list, put, ttft_into: dict | None) -> None:
        """Every load in one mode into `loads`; in the last mode the step profiles into `row`;
        TTFT into `ttft_into` (None: not measured)."""
        set_mode(engine, mode)
        for spec in self.specs:
            if not self.left():
                break
            loads.append(tokens_per_s(engine, spec, self.device))
            put()
        args = self.args
        if mode == args.modes[-1]:
            row["profile"] = {str(c): decode_profile(engine, c, PROMPT_LEN, self.device)
                              for c in args.profile_concurrency if self.left(30)}
            row["components"] = {str(c): component_profile(engine, c, PROMPT_LEN, self.device)
                                 for c in args.component_concurrency if self.left(30)}
            # the prefill steps: the largest load's prompts at once, and the longest TTFT prompt alone
            shapes = [(max(args.component_concurrency, default=1), PROMPT_LEN),
                      *((1, n) for n in args.ttft_prompts[-1:])]
            row["prefill_components"] = {f"{c}x{n}": component_profile(engine, c, n, self.device, prefill=True)
                                         for c, n in shapes if self.left(30)}
        if ttft_into is not None:
            ttft_into["ttft_s"] = {str(n): ttft(engine, n, self.device) for n in args.ttft_prompts if self.left()}
        put()


def main() -> None:
    args = parse_args()
    run = Run(args)
    bandwidth = copy_bandwidth(run.device, GiB // 16 if run.device.type == "cpu" else 2 * GiB)
    run.put("copy_bandwidth_bytes_per_s", bandwidth)
    run.build()
    run.floors(bandwidth)
    if run.whole and "hf" not in args.skip:
        run.transformers()
    if run.whole:
        run.engine_bf16()
    run.quantize()
    # 8 and 4 bits first, then the pressure comparison, then 3 bits: what the limit cuts last matters least
    run.static([b for b in args.static_bits if b != 3])
    if "pressure" not in args.skip:
        run.pressure()
    run.static([b for b in args.static_bits if b == 3])
    run.put("total_s", round(time.perf_counter() - run.started, 1))
    print(f"wrote {run.path}")


if __name__ == "__main__":
    main()
