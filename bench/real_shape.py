"""Serving speed at a real model's size, one run: transformers, our engine in bf16, the
runtime at static 8/4/3 bits, and the `pagedweight` policy under memory pressure, each
against the HBM floor measured in the same run (issues 12 and 17).

Nothing is written to disk but the result: the checkpoint is `transformers`' own class
(`Qwen2MoeForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM`, `OlmoeForCausalLM`,
`Gemma4ForCausalLM`) with random bf16 weights drawn on the device, each tensor from a
generator seeded by its name (`--seed`);
our `MoECausalLM` is assembled over the same tensors (no copy); the routed experts are
quantised by a fast nested-uniform path (`nested_uniform_planes`: per-row min-max 8-bit
codes, b-bit LUTs at the b-bit bucket centres; no calibration, so quality is not measured
here, but the planes, LUTs and their byte counts are the real format) into an in-memory
`PagedModel` that the runtime is built from (`build_runtime_from_paged`).

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
4. our engine over dense bf16 experts in each of `--modes` (issue 12: the earlier eager
   steps with the gathering attention and the per-expert loop, against CUDA-graph replay
   of decode steps with in-place attention and grouped experts); TTFT of 512- and
   4096-token prompts;
5. the runtime at static-8/4/3 (fused kernel on CUDA), same loads in each mode, TTFT at 4 bits;
6. pressure (issue 17): budget = 8-bit experts + non-expert weights + workspace + half the
   KV the load wants; `pagedweight` against `static-8` and `static-4`: tokens/s,
   preemptions, page moves, bytes copied, mean bits start/min/end.
Every load reports the graph captures and replays during it (a steady load captures none
once warm); the bf16 engine and every static width have a per-component step profile
(bench/step_components.py: ms and kernels per component of an eager step).

    PYTHONPATH=.:services:kernels python3 -m bench.real_shape --model qwen1.5-moe-a2.7b
    .venv/bin/python -m bench.real_shape --model tiny-qwen-moe --device cpu   # checks the script
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import time
from pathlib import Path

import torch

import pagedweight
from bench.bench_meta import RESULTS_DIR, commit, device_tag, gpu, machine
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

from bench.step_components import component_profile


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


def prefill_profile(engine, prompt_len: int, device: torch.device, repeats: int = 5) -> dict:
    """The first step of a request on an idle engine (its prompt's prefill and first token,
    one step when the budget holds the prompt): wall ms per step (median of `repeats`, after
    one that warms the shapes up or captures the bucket's graph), the host's ms per phase
    (Engine.phases), whether the step replayed a graph, and the kernels of one more step
    (torch.profiler: launches, summed kernel ms, and by name)."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(13)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    runner = engine.runner

    def one(i: int) -> tuple[float, bool]:
        engine.add_request(f"pf{prompt_len}-{i}", torch.randint(1, vocab, (prompt_len,), generator=gen).tolist(),
                           params)
        sync(device)
        graph_steps = runner.num_graph_steps
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        ms = 1000 * (time.perf_counter() - t0)
        replayed = runner.num_graph_steps > graph_steps
        while engine.has_work:
            engine.step()
        return ms, replayed

    one(-1)
    phases = getattr(engine, "phases", None)
    if phases is not None:
        phases.reset()
    times, replays = [], 0
    for i in range(repeats):
        ms, replayed = one(i)
        times.append(ms)
        replays += replayed
    result = {"prompt_len": prompt_len, "step_ms": round(sorted(times)[len(times) // 2], 3),
              "step_ms_all": [round(t, 3) for t in times], "replayed": replays}
    if phases is not None:  # phases count every step: the prefill steps are all of them here
        result["host_phase_ms"] = phases.per_step_ms()
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one(repeats)
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        result["kernels_per_step"] = len(kernels)
        result["kernel_ms_per_step"] = round(sum(e.time_range.elapsed_us() for e in kernels) / 1000, 3)
        by_name = collections.Counter(e.name for e in kernels)
        result["kernels_by_name"] = {name[:96]: n for name, n in by_name.most_common(40)}
        ms_by_name = collections.Counter()
        for e in kernels:
            ms_by_name[e.name[:96]] += e.time_range.elapsed_us() / 1000
        result["kernel_ms_by_name"] = {k: round(v, 3) for k, v in ms_by_name.most_common(20)}
    return result


def prefill_parity(engine, prompt_lens, device: torch.device) -> list[dict]:
    """Every replayed step of a few prompts (each prefilled in one step, then 3 decodes)
    against the same step run eagerly right after it (the varlen batched path; it rewrites
    the same KV slots): relative logit error and argmax agreement (issue 12: prefill as
    token rows must compute the eager step)."""
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
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
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


def decode_profile(engine, concurrency: int, prompt_len: int, device: torch.device, steps: int = 8) -> dict:
    """Where a decode step's time goes at `concurrency` sequences (issue 12): wall time per
    step; the host's seconds per phase of the step (`Engine.phases`: schedule, prepare,
    signature, launch, wait = reading the sampled tokens back, update, boundary), so host
    work = wall - wait; the replayed graph's device span per step (CUDA events around the
    replay); the kernels per step, their summed device time (span - sum = gaps between
    kernels inside the graph) and the top operators (torch.profiler); host syncs per step
    (torch.cuda.set_sync_debug_mode counts them). Engines without phases or replay events
    (an older checkout run with this script) leave those fields out."""
    import warnings

    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    for i in range(concurrency):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"prof{i}", prompt, SamplingParams(max_tokens=2 * steps + 16, ignore_eos=True))
    sync(device)
    t0 = time.perf_counter()
    engine.step()  # the prompts' prefill (eager), as many as the token budget takes
    sync(device)
    prefill_ms = 1000 * (time.perf_counter() - t0)
    for _ in range(3):  # the rest of the prefill and a few decodes (captures this bucket's graph)
        engine.step()
    runner = engine.runner
    graph_steps0 = runner.num_graph_steps
    result = {"concurrency": concurrency, "first_prefill_step_ms": round(prefill_ms, 3)}
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        sites = {}
        for w in caught:
            key = f"{Path(w.filename).name}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
        result["host_syncs_per_step"] = len(caught)
        result["sync_sites"] = sites
        sync(device)
    phases = getattr(engine, "phases", None)
    graphs = runner.graphs
    timed = graphs is not None and hasattr(graphs, "replay_events") and device.type == "cuda"
    if phases is not None:
        phases.reset()
    if timed:
        graphs.replay_events = []
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    result["step_ms"] = round(1000 * (time.perf_counter() - t0) / steps, 3)
    if phases is not None:
        result["host_phase_ms"] = phases.per_step_ms()
        result["host_ms_excluding_wait"] = round(sum(v for k, v in result["host_phase_ms"].items() if k != "wait"), 3)
    if timed:
        spans = [start.elapsed_time(end) for _, start, end in graphs.replay_events]
        graphs.replay_events = None
        result["replays"] = len(spans)
        result["replay_device_ms"] = round(sum(spans) / max(1, len(spans)), 3)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            engine.step()
        sync(device)
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        result["kernels_per_step"] = round(len(kernels) / 2, 1)
        result["kernel_ms_per_step"] = round(sum(e.time_range.elapsed_us() for e in kernels) / 2000, 3)
        # every kernel of the step by name, launches per step: the full list (top_ops keeps 14)
        by_name = collections.Counter(e.name for e in kernels)
        result["kernels_by_name"] = {name[:96]: n / 2 for name, n in by_name.most_common()}
    result["graph_steps"] = runner.num_graph_steps - graph_steps0
    if graphs is not None:
        result["graph_captures_total"] = graphs.num_captures
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    result["top_ops"] = prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=48)
    while engine.has_work:
        engine.step()
    return result


# ---------------------------------------------------------------- the run

def compact_json(record: dict) -> str:
    """One line per top-level key: diffs of committed results stay readable."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items())
    return "{\n" + body + "\n}\n"


def memory_now(device: torch.device) -> dict:
    """Peak device memory since the last call (then reset) and host anonymous memory now."""
    out = {"host_anon_bytes": anonymous_bytes()}
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        out["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.reset_peak_memory_stats(device)
    return out


class Report:
    """The result file, rewritten after every section."""

    def __init__(self, path: Path, header: dict):
        self.path, self.record = path, header

    def memory(self, section: str, device: torch.device) -> None:
        """The section's peak device memory and the host's memory after it, under "memory"."""
        self.put("memory", {**self.record.get("memory", {}), section: memory_now(device)})

    def put(self, key: str, value) -> None:
        self.record[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(compact_json(self.record))
        print(f"[{key}] {json.dumps(value)[:600]}", flush=True)


# How a step runs (issue 12): the earlier engine (every step eager, the batched path's
# padded gather, the per-expert loop over dense experts), the in-place decode attention
# alone, CUDA-graph replay of decode steps with prefill steps eager (the engine before
# prefill graphs), and replay of every step as token rows, prefill chunks included (the
# engine's default; graph_prefill), then the same with each layer's shared expert on a side
# stream (the engine's default; overlap_shared_experts). "-prompts": with a prompt routing
# recorder installed, as the runtime does when its artifact has residual heads (the
# production path; the in-memory artifact here has none).
MODES = {
    "eager-gather": dict(attention_impl="batched", graphs=False, grouped=False),
    "eager-inplace": dict(attention_impl="inplace", graphs=False, grouped=True),
    "graphs-eager-prefill": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=False),
    "graphs-inplace": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True),
    "graphs-overlap": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True, overlap=True),
    "graphs-eager-prefill-prompts": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=False,
                                         overlap=True, prompts=True),
    "graphs-overlap-prompts": dict(attention_impl="inplace", graphs=True, grouped=True, prefill=True, overlap=True,
                                   prompts=True),
}


def set_mode(engine, mode: str) -> None:
    """Switch a built engine between MODES (no rebuild: the runtime takes 30 s to build).
    An engine from before prefill graphs (a base checkout) takes every graphs mode as
    decode-only replay."""
    m = MODES[mode]
    set_prompt_routing(engine, m.get("prompts", False))
    runner = engine.runner
    runner.attention_impl = m["attention_impl"]
    graphs = m["graphs"] and engine.kv.device.type == "cuda"
    prefill = m.get("prefill", False) and hasattr(runner, "graph_prefill")
    if hasattr(runner, "graph_prefill"):
        runner.graph_prefill = prefill
    if hasattr(engine.model, "overlap_shared_experts"):  # before the graphs: captures bake it in
        engine.model.overlap_shared_experts(m.get("overlap", False))
    kwargs = {"max_tokens": engine.graph_tokens()} if prefill else {}
    runner.graphs = DecodeGraphs(engine.model, engine.kv, engine.config.scheduler.max_num_seqs, **kwargs) \
        if graphs else None
    for block in engine.model.moe_blocks:
        if hasattr(block.experts, "grouped"):
            block.experts.grouped = m["grouped"]


def set_prompt_routing(engine, on: bool) -> None:
    """Install (or take out) a PromptRoutingRecorder on a built engine, reserved for its
    max_num_seqs as Engine does for one it is given."""
    from pagedweight.engine.prompt_routing import PromptRoutingRecorder

    recorder = engine.prompt_routing
    if on and recorder is None:
        c = engine.model.config
        recorder = PromptRoutingRecorder(c.num_layers, c.num_experts, engine.model.device)
        recorder.install(engine.model)
        recorder.reserve_slots(engine.config.scheduler.max_num_seqs)
        engine.prompt_routing = recorder
    elif not on and recorder is not None:
        recorder.uninstall(engine.model)
        engine.prompt_routing = None


def set_gemv_tokens_per_expert(limit: float | None) -> None:
    """The expert GEMV's limit for this process (a checkout from before the GEMV has none)."""
    if limit is not None and hasattr(decode_ops, "GEMV_MAX_TOKENS_PER_EXPERT"):
        decode_ops.GEMV_MAX_TOKENS_PER_EXPERT = limit


def engine_config(max_seqs: int, max_tokens: int, num_kv_blocks: int = 1024) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
                        kv=KVCacheConfig(), num_kv_blocks=num_kv_blocks)


def main() -> None:
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
    parser.add_argument("--prefill-profile", type=int, nargs="*", default=[],
                        help="prompt lengths whose first step (prefill) is profiled in every mode")
    parser.add_argument("--skip", nargs="*", default=[], help="sections to skip: hf bf16 static pressure")
    parser.add_argument("--time-limit-s", type=float, default=540.0)
    parser.add_argument("--reserve-s", type=float, default=60.0,
                        help="time a measurement must have left to start (a runtime build: 30 s more)")
    parser.add_argument("--out", type=Path, default=None, help="result path (default bench/results/)")
    parser.add_argument("--gemv-tokens-per-expert", type=float, default=None,
                        help="assignments per expert (T k / E) up to which dense experts take the expert GEMV "
                             "(default: the code's decode_ops.GEMV_MAX_TOKENS_PER_EXPERT)")
    args = parser.parse_args()
    set_gemv_tokens_per_expert(args.gemv_tokens_per_expert)
    clock = Clock(args.time_limit_s)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    if device.type == "cpu":
        torch.set_num_threads(2)
    out = args.out or RESULTS_DIR / f"real_shape_{args.model}_{device_tag()}.json"
    report = Report(out, {"benchmark": "real_shape", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "machine": machine(), "commit": commit(), "gpu": gpu(),
                          "code_commit": os.environ.get("PAGEDWEIGHT_CODE_COMMIT", commit()),
                          "code_path": str(Path(pagedweight.__file__).parent), "label": args.label,
                          "model": args.model,
                          "dtype": "bfloat16", "args": {k: str(v) for k, v in vars(args).items()},
                          "gemv_max_tokens_per_expert": getattr(decode_ops, "GEMV_MAX_TOKENS_PER_EXPERT", None)})
    specs = [LoadSpec(max(args.min_requests, c), c, args.prompt_len, args.max_tokens) for c in args.concurrency]
    max_seqs = max(max(args.concurrency), args.pressure_concurrency)
    batched_tokens = max(512, min(2048, max(args.ttft_prompts or [0])))

    bw = copy_bandwidth(device, GiB // 16 if device.type == "cpu" else 2 * GiB)
    report.put("copy_bandwidth_bytes_per_s", bw)

    component_concurrency = args.concurrency if args.component_concurrency is None else args.component_concurrency
    _, raw = hf_config_of(args.model)
    config = ModelConfig.from_dict(raw)
    ecfg = engine_config(max_seqs, batched_tokens)
    workspace = workspace_bytes(config, ecfg, dtype)
    bf16_bytes = bf16_weight_bytes(config)
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    # the bf16 engine needs its weights, its KV room and a step's workspace at once
    bf16_needs = int(bf16_bytes + args.kv_gib * GiB + workspace)
    fits = device_bytes is None or bf16_needs <= 0.92 * device_bytes
    build = args.build if args.build != "auto" else ("whole" if fits else "layers")
    report.put("build", {"how": build, "bf16_weight_bytes": bf16_bytes, "bf16_needs_bytes": bf16_needs,
                         "device_bytes": device_bytes, "bf16_fits": fits, "seed": args.seed})
    report.memory("start", device)

    t0 = time.perf_counter()
    if build == "whole":
        hf_model, raw = build_hf_model(args.model, device, dtype, seed=args.seed)
        sync(device)
        ours = ours_from_hf(hf_model, config)
        report.put("build_s", round(time.perf_counter() - t0, 1))
        report.put("parity_vs_transformers", parity(hf_model, ours, config.vocab_size, device))
        dense = {k: v for k, v in ours.state_dict().items() if ".experts." not in k}
    else:
        paged, quantize_stats = paged_by_layer(args.model, device, dtype, args.seed,
                                               log=lambda line: print(line, flush=True))
        report.put("quantize_by_layer", quantize_stats)
        report.put("quantize_s", quantize_stats["seconds"])
        dense = paged.dense_state
        hf_model = ours = None
        skipped = {"skipped": "does not fit" if not fits else "--build layers", "bf16_needs_bytes": bf16_needs,
                   "device_bytes": device_bytes}
        report.put("parity_vs_transformers", skipped)
        report.put("transformers_generate", skipped)
        report.put("engine_bf16_dense", skipped)
    report.memory("build", device)

    # The floor: bytes per decode step over the copy bandwidth.
    dense_bytes = sum(v.numel() * v.element_size() for v in dense.values())
    embed = dense["embed_tokens.weight"]
    row_bytes = embed.shape[1] * embed.element_size()
    floors = {}
    for name, bits in [("bf16", None)] + [(f"static-{b}", b) for b in args.static_bits]:
        floors[name] = {}
        for c in args.concurrency:
            nbytes = decode_bytes(config, dense_bytes, row_bytes, embed.numel() * embed.element_size(), c, bits)
            floors[name][str(c)] = {"bytes_per_step": round(nbytes), "floor_tokens_per_s": round(c * bw / nbytes, 1)}
        if bits is None and not fits:
            floors[name]["does_not_fit"] = True
    report.put("hbm_floor", floors)

    if build == "whole" and "hf" not in args.skip:
        rows = []
        for c in args.concurrency if args.hf_concurrency is None else args.hf_concurrency:
            if clock.left() < args.reserve_s:
                rows.append({"concurrency": c, "skipped": "time limit"})
                continue
            rows.append(hf_generate_tokens_per_s(hf_model, config.vocab_size, c, args.prompt_len,
                                                 args.max_tokens, device))
            report.put("transformers_generate", rows)
        report.memory("transformers", device)

    def extras_per_mode(row: dict, engine, mode: str) -> None:
        """TTFT, the prefill profile and (with prefill graphs) their parity, in each mode:
        how the prefill runs is what the modes differ in."""
        if args.prefill_profile and clock.left() > args.reserve_s:
            row["prefill"] = {str(n): prefill_profile(engine, n, device) for n in args.prefill_profile
                              if clock.left() > args.reserve_s}
        if MODES[mode].get("prefill") and getattr(engine.runner, "graph_prefill", False) \
                and clock.left() > args.reserve_s:
            row["prefill_parity"] = prefill_parity(engine, sorted({args.prompt_len, 33, *args.prefill_profile}),
                                                   device)
        row["ttft_s"] = {str(n): ttft(engine, n, device) for n in args.ttft_prompts if clock.left() > args.reserve_s}

    def profiles(row: dict, engine) -> None:
        """The last mode's step profile and the per-component profile (eager steps)."""
        row["profile"] = {str(c): decode_profile(engine, c, args.prompt_len, device)
                          for c in args.profile_concurrency if clock.left() > args.reserve_s + 30}
        row["components"] = {str(c): component_profile(engine, c, args.prompt_len, device)
                             for c in component_concurrency if clock.left() > args.reserve_s + 30}

    if build == "whole" and "bf16" not in args.skip:
        # KV for every sequence of the largest load at once (no preemption in the bf16 rows)
        blocks = -(-5 * max(args.concurrency) * (args.prompt_len + args.max_tokens) // (4 * KVCacheConfig().block_size))
        engine = Engine(ours, engine_config(max_seqs, batched_tokens,
                                            num_kv_blocks=max(1024 if device.type == "cuda" else 512, blocks)))
        modes = {}
        for mode in args.modes:
            set_mode(engine, mode)
            row = modes[mode] = {"loads": []}
            for spec in specs:
                if clock.left() < args.reserve_s:
                    break
                row["loads"].append(tokens_per_s(engine, spec, device))
                report.put("engine_bf16_dense", modes)
            if mode == args.modes[-1]:
                profiles(row, engine)
            extras_per_mode(row, engine, mode)
            report.put("engine_bf16_dense", modes)
        del engine
        report.memory("engine_bf16", device)

    if build == "whole":
        t0 = time.perf_counter()
        paged = paged_in_memory(ours, config, raw)
        report.put("quantize_s", round(time.perf_counter() - t0, 1))
        del ours, hf_model
    del dense, embed
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report.memory("quantize", device)

    experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in paged.meta["blocks"])
    report.put("bytes", {"non_expert_weights": dense_bytes, "workspace": workspace, "experts_8bit": experts8})

    def runtime(policy: str, budget: int):
        return build_runtime_from_paged(paged, RuntimeConfig(budget, policy, device=str(device), dtype=dtype,
                                                             engine=ecfg), config.eos_token_ids)

    static = {}

    def run_static(bits_list):
        ample = int(dense_bytes + workspace + experts8 + args.kv_gib * GiB)
        for bits in bits_list:
            if clock.left() < args.reserve_s + 30:
                static[f"static-{bits}"] = {"skipped": "time limit"}
                continue
            t0 = time.perf_counter()
            rt = runtime(f"static-{bits}", ample)
            row = {"build_s": round(time.perf_counter() - t0, 1), "modes": {}}
            static[f"static-{bits}"] = row
            for mode in args.modes:
                set_mode(rt.engine, mode)
                loads = row["modes"][mode] = []
                for spec in specs:
                    if clock.left() < args.reserve_s:
                        break
                    loads.append(tokens_per_s(rt.engine, spec, device))
                    report.put("runtime_static", static)
                if mode == args.modes[-1]:
                    profiles(row, rt.engine)
                if bits == 4:  # per mode: TTFT, prefill profile, parity (the last mode's TTFT as before)
                    extras = row.setdefault("by_mode", {}).setdefault(mode, {})
                    extras_per_mode(extras, rt.engine, mode)
                    row["ttft_s"] = extras["ttft_s"]
                report.put("runtime_static", static)
            report.put("runtime_static", static)
            rt.close()
            del rt
            gc.collect()
            if device.type == "cuda":  # the next runtime's arena is one allocation as large as this one's
                torch.cuda.empty_cache()
            report.memory(f"static-{bits}", device)

    # 8 and 4 bits first, then the pressure comparison, then 3 bits: what the limit cuts last
    # matters least.
    if "static" not in args.skip:
        run_static([b for b in args.static_bits if b != 3])

    if "pressure" not in args.skip:
        kv_token = kv_block_bytes(config, 1, dtype)
        wanted = args.pressure_concurrency * (args.pressure_prompt_len + args.max_tokens) * kv_token
        budget = int(dense_bytes + workspace + experts8 + wanted // 2)
        spec = LoadSpec(args.pressure_requests, args.pressure_concurrency, args.pressure_prompt_len, args.max_tokens)
        pressure = {"budget_bytes": budget, "kv_wanted_bytes": wanted, "kv_room_at_8bit": wanted // 2,
                    "load": vars(spec), "policies": {}}
        for policy in ("static-4", "static-8", "pagedweight"):
            if clock.left() < args.reserve_s + 30:
                pressure["policies"][policy] = {"skipped": "time limit"}
                continue
            try:
                rt = runtime(policy, budget)
            except Exception as err:  # noqa: BLE001 - a policy that cannot start is a result too
                pressure["policies"][policy] = {"error": repr(err)}
                continue
            result = run_load(rt, spec)
            if rt.pager is not None:
                result["pager"] = rt.pager.stats().to_dict()
            pressure["policies"][policy] = result
            report.put("pressure", pressure)
            rt.close()
            del rt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.put("pressure", pressure)
    if "static" not in args.skip:
        run_static([b for b in args.static_bits if b == 3])
    report.put("total_s", round(clock.elapsed(), 1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
