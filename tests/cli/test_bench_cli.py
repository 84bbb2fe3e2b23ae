"""`pagedweight bench engine`: one JSON object on the last line; bad input is one line."""

from __future__ import annotations

import json

import pytest

from pagedweight.common.errors import UserError
from tests.cli.test_cli import assert_one_line_error, pagedweight

FIELDS = ("requests_completed", "requests_failed", "output_tokens_per_s", "preemptions",
          "peak_pool_bytes", "budget_bytes", "page_moves", "plans", "bits_mean_start",
          "bits_mean_min", "bits_mean_end")


@pytest.mark.slow  # generates with the whole CLI in a process: `make test`, not the inner loop
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


def test_bench_engine_plot_draws_the_memory_split(paged_micro_dir, tmp_path):
    """--plot writes a PNG of the run's memory split: a real image whose pixels are not blank,
    and the samples behind it add up to the budget at every step."""
    from pagedweight.cli.bench_cmd import run_engine_bench
    from pagedweight.cli.main import build_parser

    plot = tmp_path / "split.png"
    args = build_parser().parse_args([
        "bench", "engine", "--model", str(paged_micro_dir), "--memory-budget", "20MiB", "--requests", "6",
        "--concurrency", "3", "--prompt-len", "8", "--max-tokens", "6", "--policy", "pagedweight",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--plot", str(plot)])
    record = run_engine_bench(args)
    assert record["plot"] == str(plot)
    import matplotlib.image

    pixels = matplotlib.image.imread(plot)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 900
    assert pixels[..., :3].std() > 0.05  # drawn, not a blank canvas


def test_memory_timeline_samples_add_up_to_the_budget(paged_micro_dir):
    from pagedweight.cli.memory_timeline import MemoryTimeline
    from pagedweight.engine.engine import EngineConfig
    from pagedweight.cli.load_bench import LoadSpec, run_load
    from pagedweight.engine.scheduler import SchedulerConfig
    from pagedweight.memory.kv_cache import KVCacheConfig
    from pagedweight.runtime import RuntimeConfig, build_runtime

    config = RuntimeConfig(20 * 2**20, "pagedweight",
                           engine=EngineConfig(scheduler=SchedulerConfig(8, 64), kv=KVCacheConfig(16)))
    runtime = build_runtime(paged_micro_dir, config)
    timeline = MemoryTimeline()
    try:
        result = run_load(runtime, LoadSpec(6, 3, 8, 6), on_step=lambda: timeline.record(runtime))
    finally:
        runtime.close()
    assert len(timeline.samples) == result["steps"]  # engine steps of the load and the drain
    for s in timeline.samples:
        total = (sum(s.expert_bytes_by_bits.values()) + s.dense_bytes + s.workspace_bytes + s.transit_bytes
                 + s.kv_used_bytes + s.kv_free_bytes + s.free_bytes)
        assert total == timeline.budget_bytes == 20 * 2**20
    assert len(timeline.event_times("num_preemptions")) == result["preemptions"]
    assert len(timeline.event_times("num_page_moves")) == timeline.samples[-1].num_page_moves - timeline.samples[0].num_page_moves


@pytest.mark.slow  # generates with the whole CLI in a process: `make test`, not the inner loop
def test_bench_engine_plot_bad_path_is_one_line(paged_micro_dir, tmp_path):
    assert_one_line_error(
        pagedweight("bench", "engine", "--model", str(paged_micro_dir), "--memory-budget", "20MiB",
                    "--plot", str(tmp_path / "split.svg")),
        "--plot",
    )
    assert_one_line_error(
        pagedweight("bench", "engine", "--model", str(paged_micro_dir), "--memory-budget", "20MiB",
                    "--plot", str(tmp_path / "missing" / "split.png")),
        "does not exist",
    )
