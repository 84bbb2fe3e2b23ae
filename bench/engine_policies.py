"""The engine under load at one memory budget: pagedweight against static uniform bits.

Runs `pagedweight bench engine` (services/pagedweight/cli/bench_cmd.py) three times in one process,
same load, same budget: `pagedweight` (bits move with the load), `static-8` and
`static-4` (every expert block pinned). The budget is chosen too small for 8-bit experts
plus the load's KV, so static-8 must queue or preempt, static-4 has room at low quality,
and pagedweight lowers bits only as far as the load needs and raises them after.
Writes bench/results/engine_policies_<model>.json.

    python bench/engine_policies.py --model ../artifacts/paged/micro-mixtral --memory-budget 22MiB
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.bench_meta import write_result
from pagedweight.cli.main import build_parser

POLICIES = ("pagedweight", "static-8", "static-4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="paged model directory")
    parser.add_argument("--memory-budget", default="22MiB")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedweight.cli.bench_cmd import run_engine_bench
    from pagedweight.common.errors import UserError

    results = {}
    for policy in POLICIES:
        cli = build_parser().parse_args([
            "bench", "engine", "--model", args.model, "--memory-budget", args.memory_budget,
            "--requests", str(args.requests), "--concurrency", str(args.concurrency),
            "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
            "--policy", policy, "--device", args.device,
            "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--threads", str(args.threads),
        ])
        try:
            results[policy] = run_engine_bench(cli)
        except UserError as err:  # e.g. static-8 does not fit the budget at all
            results[policy] = {"error": str(err)}
            print(policy, results[policy])
            continue
        print(policy, {k: results[policy][k] for k in (
            "requests_completed", "output_tokens_per_s", "preemptions", "bits_mean_min", "bits_mean_end")})
    name = f"engine_policies_{Path(args.model).name}_{args.device.split(':')[0]}"
    path = write_result(name, {"load": vars(args), "baseline": "static-8 and static-4 at the same budget",
                               "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
