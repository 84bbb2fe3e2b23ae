"""The real-shape benchmark's loads pay for no graph capture: its warm-up load meets every
bucket the measured load meets (on the CPU, the graphs' plumbing without capture counts
what a capturing run would capture)."""

from __future__ import annotations

import pytest
import torch

from bench.real_shape import tokens_per_s
from pagedweight.cli.load_bench import LoadSpec
from pagedweight.engine.decode_graphs import DecodeGraphs
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from tests.conftest import BUNDLED_MODEL


@pytest.mark.parametrize("concurrency", [4, 8])
def test_the_measured_load_captures_nothing_its_warm_up_did_not(concurrency):
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    for block in model.moe_blocks:  # the grouped experts, as on CUDA
        block.experts.grouped = True
    # prompts of 32 tokens in steps of 48: the prefill of the batch takes several steps, so
    # the first requests decode while the last ones still prefill
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=concurrency, max_num_batched_tokens=48),
                          kv=KVCacheConfig(block_size=4), attention_impl="inplace", num_kv_blocks=1024)
    engine = Engine(model, config=config)
    engine.runner.graphs = DecodeGraphs(model, engine.kv, concurrency, capture=False, max_tokens=48)
    load = tokens_per_s(engine, LoadSpec(concurrency, concurrency, 32, 12), torch.device("cpu"))
    assert load["completed"] == concurrency and load["graph_replays"] > 0
    assert load["graph_captures"] == 0, load
