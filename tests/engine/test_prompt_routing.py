"""Each request's prompt routing as the engine prefills it, and the mix a plan request carries.

Reference: a plain prefill of each prompt alone with the offline recorder
(offline.prompt_routing). Chunked prefill, several prompts and decodes in one batch, and
preemption (the prompt recomputed) must give exactly its counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedweight.engine.decode_graphs import DecodeGraphs
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.prompt_routing import PromptRoutingRecorder, prompt_mix, remaining_tokens
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.engine.sequence import Sequence, SequenceStatus
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from pagedweight.offline.prompt_routing import record_prompt_routing
from pagedweight.weights.routing_feed import RoutingFeed
from tests.conftest import BUNDLED_MODEL

PROMPT_LENS = (3, 17, 33, 5, 40, 1, 29, 12)
MAX_TOKENS = (10, 5, 12, 9, 8, 11, 7, 6)


@pytest.fixture(scope="module")
def model():
    return load_model(BUNDLED_MODEL, dtype=torch.float32)


def prompts(model):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def engine_with_recorder(model, num_blocks, token_budget, graphs=False):
    """graphs: every step through the decode graphs' static buffers as token rows (their CPU
    plumbing, capture off: the code a CUDA replay runs), padding rows and all."""
    c = model.config
    feed = RoutingFeed(c.num_layers, c.num_experts)
    feed.install(model)
    recorder = PromptRoutingRecorder(c.num_layers, c.num_experts)
    recorder.install(model)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=token_budget),
                          kv=KVCacheConfig(block_size=4), attention_impl="inplace" if graphs else "reference",
                          num_kv_blocks=num_blocks)
    engine = Engine(model, config, prompt_routing=recorder)
    if graphs:
        for block in model.moe_blocks:  # what graphs need (CUDA's default)
            block.experts.grouped = True
        engine.runner.graphs = DecodeGraphs(model, engine.kv, 64, capture=False, max_tokens=token_budget)
    return engine, feed, recorder


def detach(model):
    for block in model.moe_blocks:
        block.observer = None
        block.experts.grouped = None


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("num_blocks,token_budget", [(1024, 512), (16, 24)])
def test_each_prompts_counts_equal_a_plain_prefill_of_it(model, num_blocks, token_budget, graphs):
    """(16, 24): chunked prefill and preemption by recompute. graphs: the steps as the decode
    graphs run them, the prompt rows recorded from the static buffers (padding rows not)."""
    ps = prompts(model)
    references = [record_prompt_routing(model, p, model.config.num_experts).counts for p in ps]
    engine, feed, recorder = engine_with_recorder(model, num_blocks, token_budget, graphs)
    try:
        for i, (p, m) in enumerate(zip(ps, MAX_TOKENS)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
        seqs = list(engine.seqs.values())
        engine.run_to_completion()
        if num_blocks == 16:
            assert engine.scheduler.num_preemptions > 0
        for seq, p, want in zip(seqs, ps, references):
            assert seq.num_prompt_tokens_routed == len(p)
            np.testing.assert_array_equal(seq.prompt_counts, want)
        # the routing feed in front of it still saw every token (prompts, recomputes, decodes)
        assert feed.snapshot().num_tokens.min() >= sum(PROMPT_LENS)
        assert recorder.mix() is None  # every request finished: nothing in flight
        if graphs:  # every step, the prefills too, went through the graphs
            runner = engine.runner
            assert runner.num_eager_steps == 0 and runner.graphs.prefill_steps > 0
            assert runner.graphs.padding_rows > 0
    finally:
        detach(model)


def test_graph_rows_say_whether_a_replay_can_record_the_step(model):
    """What the decode graphs ask before a step: None (no prompt rows: a graph without the
    recording), each row's offset into the static counts, or False where the recorder has
    no reserved slots (no static counts: the step must run eagerly, or nothing is recorded)."""
    c = model.config
    recorder = PromptRoutingRecorder(c.num_layers, c.num_experts)
    recorder.install(model)
    try:
        engine = Engine(model, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                                            kv=KVCacheConfig(block_size=4), num_kv_blocks=256))  # reserves nothing
        graphs = DecodeGraphs(model, engine.kv, 4, capture=False, max_tokens=64)
        prompt = prompts(model)[1]
        engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        scheduled = engine.scheduler.schedule().scheduled
        recorder.begin_step(scheduled)
        assert recorder.graph_rows() is False and graphs._prompt_rows() is False
        recorder.reserve_slots(4)
        recorder.begin_step(scheduled)
        assert recorder.graph_rows().tolist() == [0] * len(prompt)  # slot 0 for every row
        recorder.begin_step([])
        assert recorder.graph_rows() is None and graphs._prompt_rows() is None
    finally:
        detach(model)


def test_uninstall_puts_back_the_observers_behind_it(model):
    c = model.config
    feed = RoutingFeed(c.num_layers, c.num_experts)
    feed.install(model)
    recorder = PromptRoutingRecorder(c.num_layers, c.num_experts)
    recorder.install(model)
    try:
        assert all(block.observer is recorder for block in model.moe_blocks)
        recorder.uninstall(model)
        assert all(block.observer is feed for block in model.moe_blocks)
    finally:
        detach(model)


def test_decode_steps_record_nothing(model):
    engine, _, recorder = engine_with_recorder(model, 1024, 512)
    try:
        engine.add_request("a", prompts(model)[1], SamplingParams(max_tokens=6, ignore_eos=True))
        seq = engine.seqs["a"]
        engine.step()  # the whole prompt in one step
        after_prefill = seq.prompt_counts.copy()
        while engine.has_work:
            engine.step()
            assert recorder._rows is None  # decode-only steps: no map, no counting
        np.testing.assert_array_equal(seq.prompt_counts, after_prefill)
    finally:
        detach(model)


def sequence(seq_id, prompt_len, max_tokens, computed, counts):
    s = Sequence(seq_id, str(seq_id), [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    s.num_computed_tokens, s.prompt_counts = computed, counts
    return s


def test_the_mix_weights_each_prompt_by_the_tokens_its_request_still_runs():
    a = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 2.0]])  # layer fractions (.75 .25 0), (0 .5 .5)
    b = np.array([[0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    sa = sequence(0, 4, 10, 6, a)  # 14 - 6 = 8 tokens left
    sb = sequence(1, 5, 3, 6, b)  # 8 - 6 = 2 tokens left
    assert (remaining_tokens(sa), remaining_tokens(sb)) == (8, 2)
    mix = prompt_mix([sa, sb], residual_of=lambda r: r.ravel() * 2)
    want = (8 * np.array([[.75, .25, 0], [0, .5, .5]]) + 2 * np.array([[0, 0, 1], [1, 0, 0]])) / 10
    np.testing.assert_allclose(mix.routing, want)
    np.testing.assert_allclose(mix.residual, want.ravel() * 2)
    assert (mix.num_prompts, mix.num_tokens) == (2, 10)
    sb.status = SequenceStatus.FINISHED  # a request that left drops out
    np.testing.assert_allclose(prompt_mix([sa, sb]).routing, want * 0 + np.array([[.75, .25, 0], [0, .5, .5]]))
    sa.num_computed_tokens = 14  # nothing left to run: no weight
    assert prompt_mix([sa, sb]) is None
    assert prompt_mix([sequence(2, 4, 4, 0, None)]) is None  # not prefilled yet


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_record_each_prompt_as_the_eager_engine_does():
    """bf16 on CUDA (where graphs run): every step replayed, prefills included, with the
    recording captured in; each prompt's counts total its tokens x top-k per layer exactly
    (no row lost, no padding row counted) and match the eager engine's counts up to the
    few choices bf16 rounding may flip between the two forms (the graphs' attention and
    RoPE round differently: docs/engine.md)."""
    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16, device="cuda")
    c = model.config
    ps = prompts(model)
    counts = {}
    for eager in (True, False):
        recorder = PromptRoutingRecorder(c.num_layers, c.num_experts, "cuda")
        recorder.install(model)
        try:
            config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                                  kv=KVCacheConfig(block_size=4), num_kv_blocks=512, enforce_eager=eager)
            engine = Engine(model, config, prompt_routing=recorder)
            for i, (p, m) in enumerate(zip(ps, MAX_TOKENS)):
                engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
            seqs = list(engine.seqs.values())
            engine.run_to_completion()
            if not eager:
                graphs = engine.runner.graphs
                assert engine.runner.num_eager_steps == 0 and graphs.prefill_steps > 0 and graphs.padding_rows > 0
                assert not graphs.disabled and not graphs.prefill_disabled
            counts[eager] = [seq.prompt_counts for seq in seqs]
        finally:
            detach(model)
    k = c.num_experts_per_tok
    for got, want, p in zip(counts[False], counts[True], ps):
        np.testing.assert_array_equal(got.sum(-1), np.full(c.num_layers, len(p) * k))
        assert np.abs(got - want).sum() <= 0.05 * len(p) * k * c.num_layers
