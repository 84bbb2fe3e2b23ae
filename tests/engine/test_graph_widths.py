"""Graphs per (row bucket, table width class) and the capture counters (engine/decode_graphs.py).

On the CPU the graphs' plumbing runs without capture and counts what a capturing run would
capture and replay: a steady decode run captures nothing after its first steps, a decode
crossing a width class captures once more, and Gemma-4's layers narrower than the cache's
slot (their attention takes the torch decode path, whose work follows the table's width)
read a table of the step's width class, not the model's 262,144-position context, and
give the greedy tokens of the eager engine."""

from __future__ import annotations

import torch

from pagedweight.engine.decode_graphs import DecodeGraphs, table_widths
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf
from tests.engine.test_decode_graphs import _grouped_model

BLOCK = 4


def test_table_widths_grow_4x_up_to_the_context():
    assert table_widths(512) == (16, 64, 256, 512)
    assert table_widths(16384) == (16, 64, 256, 1024, 4096, 16384)
    assert table_widths(10) == (10,) and table_widths(16) == (16,)


def _engine(model, max_seqs=4, graphs=True):
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64),
                          kv=KVCacheConfig(block_size=BLOCK), attention_impl="inplace", num_kv_blocks=512)
    engine = Engine(model, config=config)
    engine.runner.graphs = DecodeGraphs(model, engine.kv, max_seqs, capture=False, max_tokens=64) if graphs else None
    return engine


def _decode_steps(engine, n: int) -> None:
    for _ in range(n):
        engine.step()


def test_a_steady_decode_run_does_not_capture_again():
    """Four sequences decoding together: after the prefill step and the first decode step
    (one capture each), 20 more decode steps capture nothing and replay every step."""
    model = _grouped_model()
    engine = _engine(model)
    graphs = engine.runner.graphs
    for i in range(4):
        engine.add_request(str(i), [5 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True))
    _decode_steps(engine, 2)  # the prefill step, the first decode step
    captures, replays = graphs.num_captures, graphs.num_replays
    assert captures == 2
    _decode_steps(engine, 20)  # contexts 7 .. 27 tokens: 7 blocks at most, in the first width class
    assert graphs.num_captures == captures
    assert graphs.num_replays == replays + 20
    assert set(graphs.steps_per_width) == {graphs.table_widths[0]}


def test_crossing_a_width_class_captures_once():
    """One sequence decoding past the first width class (16 blocks = 64 tokens here):
    one more capture at the crossing, none after it."""
    model = _grouped_model()
    engine = _engine(model)
    graphs = engine.runner.graphs
    engine.add_request("long", [7] * 60, SamplingParams(max_tokens=20, ignore_eos=True))
    _decode_steps(engine, 2)  # prefill (60 tokens, 15 blocks), one decode: 61 tokens
    assert graphs.num_captures == 2
    _decode_steps(engine, 10)  # 62 .. 71 tokens: crosses 64 tokens once
    assert graphs.num_captures == 3
    assert set(graphs.steps_per_width) == set(graphs.table_widths[:2])


def _tiny_gemma4():
    hf, raw = build_hf_model("tiny-gemma4", torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # weights that keep activations O(1), so greedy tokens depend on them
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model = ours_from_hf(hf, ModelConfig.from_dict(raw))
    for block in model.moe_blocks:
        block.experts.grouped = True
    return model


def test_gemma4_steps_read_the_width_class_not_the_whole_context():
    """tiny-gemma4 keeps Gemma-4-26B-A4B's 262,144 positions (65,536 blocks of 4): its
    steps through the graphs' buffers read tables of their width class and give the eager
    engine's greedy tokens; its decode run captures once per bucket and width."""
    model = _tiny_gemma4()
    assert model.config.max_position_embeddings == 262144
    prompts = [[3 + i, 9, 4 + 2 * i, 7] * (3 + 4 * i) for i in range(3)]  # 12, 28, 44 tokens

    def run(graphs: bool):
        engine = _engine(model, graphs=graphs)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=30, ignore_eos=True))
        return engine, engine.run_to_completion()

    eager, expected = run(graphs=False)
    engine, out = run(graphs=True)
    graphs = engine.runner.graphs
    assert out == expected
    assert graphs.width == 65536 and engine.runner.num_eager_steps == 0
    assert max(graphs.steps_per_width) == 64  # contexts of 74 tokens at most: 19 blocks
    # every (bucket, width) captured once: replays are the rest of the steps
    assert graphs.num_captures == len(graphs.graphs)
    assert graphs.num_captures + graphs.num_replays == engine.runner.num_graph_steps
    assert graphs.num_replays > graphs.num_captures
