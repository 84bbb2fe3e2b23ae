"""Do online prompt residuals help held-out quality at a fixed budget? With and without, same run.

For each shared model (paged artifacts made by `pagedweight quantize`) the real worker
runtime (runtime.build_runtime: engine, weight pager, in-process planner, policy
`pagedweight`) starts with every expert block at 8 bits and serves a prompt mix: four
requests of PROMPT tokens each, taken from the `valid` texts. Once every prompt is
prefilled, KV pressure asks the pager for the bytes that bring the experts down to a
budget (a fraction of the bf16 experts' bytes); the plan the planner returns is the
measured plan. The runtime is built twice per cell, with `prompt_residuals` on (the
plan request carries the prompts in flight through the artifact's residual heads) and
off (routing only); everything else is the same, so the two plans see the same routing.

Each plan is scored by the mean per-token KL(bf16 || plan) and perplexity on EVAL held-out
tokens of each domain in the mix (the tokens after the prompts' text, never seen by the
planner), weighted like the mix. Mixes: each domain alone, and a code-heavy and a
prose-heavy mix of domains.

    python -m bench run online-residuals --artifacts DIR     # DIR/<model> from `pagedweight quantize`

Writes bench/results/online_residuals.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.bench_meta import log, write_result
from bench.quality_budget import Scorer, windows_of
from pagedweight.common.paths import corpus_dir
from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.runtime import RuntimeConfig, build_runtime, workspace_bytes

MODELS = ("micro-mixtral", "tiny-mixtral", "tiny-qwen-moe")
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")
MIXES = {**{d: (d, d, d, d) for d in DOMAINS},
         "code-heavy": ("pycode", "pycode", "cheader", "kjv"),
         "prose-heavy": ("kjv", "kjv", "pydoc", "pycode")}
FRACTIONS = (0.25, 0.30, 0.40)  # of the bf16 experts' bytes (all-3-bit is 21-24% on these models)
ENGINE = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                      kv=KVCacheConfig(block_size=16))


class Texts:
    """Per domain: the prompts' text (the first 4 * PROMPT tokens of `valid`) and the
    held-out windows after it."""

    def __init__(self, tokenizer, prompt: int, eval_tokens: int, window: int):
        self.prompts, self.windows = {}, {}
        for d in DOMAINS:
            ids = tokenizer.encode((corpus_dir() / f"{d}.valid.txt").read_text())
            self.prompts[d] = [ids[i * prompt:(i + 1) * prompt] for i in range(4)]
            self.windows[d] = windows_of(ids[4 * prompt:], window, eval_tokens // window)

    def mix_prompts(self, mix: tuple[str, ...]) -> list[list[int]]:
        used: dict[str, int] = {}
        out = []
        for d in mix:  # the i-th prompt of a domain that appears i+1 times
            out.append(self.prompts[d][used.get(d, 0)])
            used[d] = used.get(d, 0) + 1
        return out


def runtime_budget(paged) -> int:
    """Dense weights, workspace, every expert block at 8 bits and 4096 tokens of KV."""
    c = paged.config
    dense = sum(t.numel() for t in paged.dense_state.values()) * 4
    experts = sum(paged.block_bytes(b, 8) for b in paged.block_ids)
    kv = 4096 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    return dense + workspace_bytes(c, ENGINE, torch.float32) + experts + kv + (1 << 20)


def online_plan(model_dir: Path, paged, prompts, target_bytes: int, prompt_residuals: bool, max_tokens: int):
    """The bits (block key -> bits) the live planner gives when pressure brings the experts'
    arena bytes to `target_bytes` with `prompts` in flight; and what the request carried."""
    runtime = build_runtime(model_dir, RuntimeConfig(runtime_budget(paged), "pagedweight", engine=ENGINE,
                                                     prompt_residuals=prompt_residuals))
    try:
        engine, table = runtime.engine, runtime.table
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        seqs = list(engine.seqs.values())
        while any(s.num_computed_tokens < len(s.prompt_ids) for s in seqs):
            engine.step()
        now = sum(table.charged_bytes(bid, e.desired_bits) for bid, e in table.entries.items())
        runtime.pager.request_bytes(max(now - target_bytes, 0))
        residual = runtime.pager.planner.context.residual
        bits = {bid.key(): e.desired_bits for bid, e in table.entries.items()}
        charged = sum(table.charged_bytes(bid, e.desired_bits) for bid, e in table.entries.items())
        return bits, charged, residual
    finally:
        runtime.close()


def evaluate_model(name: str, args) -> dict:
    started = time.perf_counter()
    model_dir = Path(args.artifacts) / name
    sc = Scorer(model_dir)
    texts = Texts(sc.tokenizer, args.prompt_tokens, args.eval_tokens, args.window)
    bf16_bytes = sc.bf16_expert_bytes()
    keys = [b.key() for b in sc.table.block_ids]
    rows = []
    cells = [(m, f) for m in args.mixes for f in FRACTIONS]
    for n, (mix_name, fraction) in enumerate(cells, 1):
        mix = MIXES[mix_name]
        prompts = texts.mix_prompts(mix)
        target = int(fraction * bf16_bytes)
        row = {"mix": mix_name, "fraction": fraction, "budget_bytes": target}
        plans = {}
        for label, flag in (("online", True), ("routing_only", False)):
            bits, charged, residual = online_plan(model_dir, sc.paged, prompts, target, flag, args.max_tokens)
            plans[label] = np.array([bits[k] for k in keys])
            row[label] = {"arena_bytes": charged, "mean_bits": float(plans[label].mean())}
            if flag:
                row["residual_std"] = float(np.std(residual)) if residual is not None else None
        row["blocks_differ"] = int((plans["online"] != plans["routing_only"]).sum())
        for label, bits in plans.items():
            kl = ppl = 0.0
            for d in mix:  # each prompt's domain counts once: the mix's weights
                s = sc.score(bits, d, texts.windows[d])
                kl, ppl = kl + s["kl"] / len(mix), ppl + s["ppl"] / len(mix)
            row[label].update(kl=kl, ppl=ppl)
        row["kl_change"] = row["online"]["kl"] / row["routing_only"]["kl"] - 1
        rows.append(row)
        log(f"[{name} {n}/{len(cells)}] {mix_name} {fraction:.0%}: KL online {row['online']['kl']:.5f} "
            f"routing-only {row['routing_only']['kl']:.5f} ({row['kl_change']:+.2%}), "
            f"{row['blocks_differ']} blocks differ, {time.perf_counter() - started:.0f}s "
            f"(ETA {(time.perf_counter() - started) / n * (len(cells) - n):.0f}s)")
    return {"bf16_expert_bytes": bf16_bytes, "rows": rows, "seconds": time.perf_counter() - started,
            "summary": summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    changes = [r["kl_change"] for r in rows]
    return {"cells": len(rows), "online_better": sum(c < 0 for c in changes),
            "online_worse": sum(c > 0 for c in changes), "ties": sum(c == 0 for c in changes),
            "mean_kl_online": float(np.mean([r["online"]["kl"] for r in rows])),
            "mean_kl_routing_only": float(np.mean([r["routing_only"]["kl"] for r in rows])),
            "median_kl_change": float(np.median(changes))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", required=True, help="folder of paged models, one per name in --models")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (four per mix)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--eval-tokens", type=int, default=512, help="held-out scored tokens per domain")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for name in args.models:
        if not (Path(args.artifacts) / name / "paged_model.json").is_file():
            print(f"error: {Path(args.artifacts) / name} is not a paged model directory", file=sys.stderr)
            raise SystemExit(2)
    torch.set_num_threads(args.threads)
    results = {name: evaluate_model(name, args) for name in args.models}
    payload = {"config": {k: v for k, v in vars(args).items() if k != "artifacts"}, "fractions": FRACTIONS,
               "mix_domains": {m: MIXES[m] for m in args.mixes}, "results": results}
    path = write_result("online_residuals" if len(args.models) == len(MODELS) else
                        "online_residuals_" + "_".join(args.models), payload)
    for name, res in results.items():
        print(name, res["summary"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
