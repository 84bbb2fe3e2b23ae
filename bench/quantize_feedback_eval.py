"""Error feedback in the quantiser (`quantize --error-feedback`) against the plain k-means
seed, on the planner's mix: KL to bf16 and perplexity at expert-byte budgets (issue 14).

Each artifact pair is the same model quantised with and without the option (everything
else default). Per variant, bench/quality_budget.py's scoring: per domain the first
PROMPT tokens of the domain's `valid` text are the traffic the planner sees, the next
EVAL tokens are scored, KL(bf16 || plan) and perplexity, for `pagedweight` (the planner
with the artifact's own tables and loss scales) and the uniform baselines; plus the
uniform width alone (every block at 3, 4, 5 bits), which shows where the nested
feedback gains and where it loses.

    python -m bench.quantize_feedback_eval --variant plain=/tmp/a/tiny-mixtral \
        --variant feedback=/tmp/b/tiny-mixtral --threads 1
    python -m bench.quantize_feedback_eval --combine A.json B.json --out-name NAME  # runs side by side
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.bench_meta import write_result
from bench.quality_budget import DOMAINS, Scorer, windows_of
from pagedweight.common.paths import corpus_dir
from pagedweight.planner.policies import make_policy

POLICIES = ("pagedweight", "uniform", "uniform-fill")


def evaluate(model_dir: Path, fractions: list[float], uniform_bits: list[int], args) -> dict:
    started = time.perf_counter()
    sc = Scorer(model_dir)
    policies = {p: make_policy(p, sc.table, scales=sc.inputs.scales) for p in POLICIES}
    bf16_bytes = sc.bf16_expert_bytes()
    quantizer = sc.paged.meta["quantizer"]["config"]
    out = {"artifact": str(model_dir), "quantizer": quantizer, "bf16_expert_bytes": bf16_bytes,
           "domains": {}, "mean": {}}
    for domain in DOMAINS:
        ids = sc.tokenizer.encode((corpus_dir() / f"{domain}.valid.txt").read_text())
        context = sc.context(ids[: args.prompt_tokens])
        windows = windows_of(ids[args.prompt_tokens:], args.seq_len, args.eval_tokens // args.seq_len)
        row = {"bf16_ppl": sc.bf16_ppl(domain, windows)}
        for f in fractions:
            budget = int(f * bf16_bytes)
            for p, policy in policies.items():
                plan = policy.plan(budget, context)
                row[f"{p}@{f}"] = {**sc.score(plan.bits, domain, windows), "mean_bits": float(plan.bits.mean())}
        for b in uniform_bits:
            row[f"all-{b}-bit"] = sc.score(np.full(sc.table.num_blocks, b), domain, windows)
        out["domains"][domain] = row
        print(f"{model_dir} {domain}: " + " ".join(f"{k}={v['kl']:.4f}" for k, v in row.items() if k != "bf16_ppl"),
              file=sys.stderr, flush=True)
    keys = [k for k in out["domains"][DOMAINS[0]] if k != "bf16_ppl"]
    rows = out["domains"].values()
    out["mean"] = {k: {"kl": float(np.mean([r[k]["kl"] for r in rows])),
                       "ppl": float(np.mean([r[k]["ppl"] for r in rows]))} for k in keys}
    out["mean_bf16_ppl"] = float(np.mean([r["bf16_ppl"] for r in rows]))
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                        help="no measuring: merge earlier runs' results (one variant each, run side by side)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="a paged model directory and the name it is reported under")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.30])
    parser.add_argument("--uniform-bits", type=int, nargs="*", default=[3, 4, 5])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=256, help="scored tokens per domain")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-name", default="quantize_feedback_eval")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.combine:
        parts = [json.loads(Path(f).read_text()) for f in args.combine]
        payload = {k: parts[0][k] for k in ("fractions", "prompt_tokens", "eval_tokens", "seq_len")}
        payload["runs"] = [{k: p[k] for k in ("date", "machine", "commit", "command")} for p in parts]
        payload["results"] = results = {name: r for p in parts for name, r in p["results"].items()}
    else:
        if not args.variant:
            parser.error("give --variant NAME=DIR (or --combine)")
        variants = dict(v.split("=", 1) for v in args.variant)
        results = {name: evaluate(Path(d), args.fractions, args.uniform_bits, args) for name, d in variants.items()}
        payload = {"fractions": args.fractions, "prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens,
                   "seq_len": args.seq_len, "results": results,
                   "command": "python -m bench.quantize_feedback_eval " + " ".join(sys.argv[1:])}
    path = write_result(args.out_name, payload)
    for name, r in results.items():
        print(name, {k: f"{v['kl']:.4f} ({v['ppl']:.3f})" for k, v in r["mean"].items()})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
