"""Variant of the planner evaluation: the artifact's Gauss-Newton table as S.

Same protocol as bench/planner_eval.py (prompt/eval split, steady-traffic context, loss
scales measured on calib text for each table), at budgets 3.5, 4 and 5 bits, for:
`pagedweight` with the output-space S (the main evaluation's), `pagedweight` with the
Gauss-Newton S (`sensitivity_gn`), both loss-scaled, and `uniform`.
Writes bench/results/planner_eval_gn.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench.bench_meta import write_result
from bench.planner_eval import ARTIFACTS, DOMAINS, Evaluator, add_eval_args, domain_tokens, log
from pagedweight.planner.policies import make_policy

WIDTHS = (3.5, 4, 5)
TABLES = ("sensitivity", "sensitivity_gn")


def evaluate(name: str, args) -> dict:
    started = time.perf_counter()
    evaluators = {t: Evaluator(ARTIFACTS / name, args.seq_len, sensitivity=t) for t in TABLES}
    base = evaluators["sensitivity"]
    for t, ev in evaluators.items():  # one model in memory: share it
        if ev is not base:
            ev.model, ev._cache = base.model, base._cache
    policies = {f"pagedweight[{t}]": make_policy("pagedweight", ev.table, scales=ev.loss_scales())
                for t, ev in evaluators.items()}
    policies["uniform"] = make_policy("uniform", base.table)
    out = {}
    for domain in DOMAINS:
        prompt_ids, eval_ids = domain_tokens(base, domain, args.prompt_tokens, args.eval_tokens)
        context = base.context(prompt_ids)
        out[domain] = {}
        for width in WIDTHS:
            budget = base.table.uniform_bytes(width)
            out[domain][str(width)] = {p: base.ppl(pol.plan(budget, context).bits, eval_ids, domain)
                                       for p, pol in policies.items()}
            log(f"{name} {domain} {width}: {out[domain][str(width)]}")
    means = {str(w): {p: float(np.mean([out[d][str(w)][p] for d in DOMAINS])) for p in policies} for w in WIDTHS}
    return {"per_domain": out, "mean_ppl": means, "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_eval_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {name: evaluate(name, args) for name in args.models}
    path = write_result("planner_eval_gn", {
        "prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens, "seq_len": args.seq_len,
        "command": "python -m bench.planner_eval_gn " + " ".join(sys.argv[1:]), "results": results})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
