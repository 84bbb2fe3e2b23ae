"""The noise band of the planner evaluation: uniform 3..8-bit perplexity on its exact tokens.

bench/planner_eval.py compares policies whose plans differ by a fraction of a bit. How
much of a difference is signal? Quantisation itself moves perplexity by a small random
amount once the error is small: on these tiny models the uniform 5, 6, 7 and 8-bit
models differ by about as much as the policies do at 4-5 bits. This script scores the
uniform widths on the same tokens (same prompt/eval split, same windows) and writes
bench/results/planner_eval_reference.json; docs/planner_eval.md quotes the band.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.bench_meta import write_result
from bench.planner_eval import ARTIFACTS, DOMAINS, Evaluator, add_eval_args, domain_tokens, log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_eval_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {}
    for name in args.models:
        ev = Evaluator(ARTIFACTS / name, args.seq_len)
        results[name] = {}
        for domain in DOMAINS:
            _, eval_ids = domain_tokens(ev, domain, args.prompt_tokens, args.eval_tokens)
            ppl = {str(b): ev.ppl(np.full(ev.table.num_blocks, b), eval_ids, domain) for b in range(3, 9)}
            high = [ppl[str(b)] for b in range(5, 9)]
            results[name][domain] = {"uniform_ppl": ppl, "band_5_to_8": max(high) - min(high),
                                     "band_5_to_8_relative": (max(high) - min(high)) / ppl["8"]}
            log(f"{name} {domain}: " + " ".join(f"{b}={v:.3f}" for b, v in ppl.items()))
    path = write_result("planner_eval_reference", {
        "prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens, "seq_len": args.seq_len,
        "command": "python -m bench.planner_eval_reference " + " ".join(sys.argv[1:]), "results": results})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
