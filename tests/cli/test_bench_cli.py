"""`pagedweight bench engine`: one JSON object on the last line; bad input is one line."""

from __future__ import annotations

import json

import pytest

from pagedweight.common.errors import UserError
from tests.cli.test_cli import assert_one_line_error, pagedweight

FIELDS = ("requests_completed", "requests_failed", "output_tokens_per_s", "preemptions",
          "peak_pool_bytes", "budget_bytes", "page_moves", "plans", "bits_mean_start",
          "bits_mean_min", "bits_mean_end")


def test_bench_engine_prints_the_fields_and_stays_in_budget(paged_micro_dir):
    result = pagedweight("bench", "engine", "--model", str(paged_micro_dir), "--memory-budget", "20MiB",
                         "--requests", "6", "--concurrency", "3", "--prompt-len", "8", "--max-tokens", "4",
                         "--policy", "static-8", "--max-num-seqs", "8", "--max-num-batched-tokens", "64")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(field in record for field in FIELDS)
    assert record["requests_completed"] == 6 and record["requests_failed"] == 0
    assert 0 < record["peak_pool_bytes"] <= record["budget_bytes"] == 20 * 2**20
    assert record["bits_mean_start"] == record["bits_mean_end"] == 8.0 and record["page_moves"] == 0


def test_bench_engine_bad_input_is_one_line(paged_micro_dir):
    assert_one_line_error(
        pagedweight("bench", "engine", "--model", str(paged_micro_dir), "--memory-budget", "lots"),
        "--memory-budget",
    )


def test_bench_engine_budget_below_the_dense_weights_is_a_user_error(paged_micro_dir):
    from pagedweight.cli.bench_cmd import run_engine_bench
    from pagedweight.cli.main import build_parser

    for budget, policy, fragment in (("1MiB", "pagedweight", "memory budget"),
                                     ("12MiB", "static-8", "static-8"),
                                     ("20MiB", "static-2", "static")):
        args = build_parser().parse_args(["bench", "engine", "--model", str(paged_micro_dir),
                                          "--memory-budget", budget, "--policy", policy])
        with pytest.raises(UserError, match=fragment):
            run_engine_bench(args)
