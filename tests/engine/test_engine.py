"""The continuous-batching engine against single-stream generation, and its bookkeeping."""

from __future__ import annotations

import pytest
import torch

from pagedweight.common.errors import ContextLengthError, UserError
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL

PROMPT_LENS = (3, 17, 33, 5, 40, 1, 29, 12)
MAX_TOKENS = (10, 5, 12, 9, 8, 11, 7, 6)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(BUNDLED_MODEL, dtype=torch.float32)


@pytest.fixture(scope="module")
def requests(model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    expected = [generate(model, p, sp).token_ids for p, sp in zip(prompts, params)]
    return prompts, params, expected


def make_engine(model, num_blocks=1024, max_seqs=64, token_budget=512, impl="reference", **kw):
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=token_budget),
        kv=KVCacheConfig(block_size=4), attention_impl=impl, num_kv_blocks=num_blocks,
    )
    return Engine(model, config=config, **kw)


def run_all(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    out = engine.run_to_completion()
    return [out[str(i)] for i in range(len(prompts))]


def assert_all_blocks_free(engine):
    assert engine.kv.manager.num_used_blocks == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("impl", ["reference", "batched", "inplace"])
def test_concurrent_greedy_equals_single_stream(model, requests, impl):
    prompts, params, expected = requests
    engine = make_engine(model, impl=impl)
    assert run_all(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("impl", ["reference", "batched", "inplace"])
def test_equal_after_preemption_and_chunked_prefill(model, requests, impl):
    """A cache too small for everyone forces preemption (recompute); a small token budget
    splits prompts into chunks. Outputs must not change."""
    prompts, params, expected = requests
    engine = make_engine(model, num_blocks=16, token_budget=24, impl=impl)
    assert run_all(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_running_cap_holds_and_only_running_sequences_hold_blocks(model, requests):
    prompts, params, expected = requests
    engine = make_engine(model, num_blocks=64, max_seqs=3, token_budget=20)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(engine.scheduler.running) <= 3
        used = sum(len(s.block_ids) for s in engine.scheduler.running)
        assert engine.kv.manager.num_used_blocks == used  # only running sequences hold blocks
    assert [outputs[str(i)] for i in range(len(prompts))] == expected


def test_scheduler_mixes_prefill_and_decode_under_budget(model):
    engine = make_engine(model, token_budget=10)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # a: prefill
    engine.add_request("b", list(range(1, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
    plan = engine.scheduler.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.num_tokens == 10


def test_abort_frees_blocks_and_reports_abort(model, requests):
    prompts, params, expected = requests
    engine = make_engine(model, num_blocks=64)
    for i, (p, sp) in enumerate(zip(prompts[:4], params[:4])):
        engine.add_request(str(i), p, sp)
    engine.step()
    engine.step()
    held = len(engine.seqs["2"].block_ids)
    used = engine.kv.manager.num_used_blocks
    out = engine.abort("2")
    assert out.finished and out.finish_reason == "abort"
    assert engine.kv.manager.num_used_blocks == used - held
    assert engine.abort("2") is None
    rest = engine.run_to_completion()
    # the others are untouched by the abort
    for i in (0, 1, 3):
        assert engine_outputs_tail(rest[str(i)], expected[i])
    assert_all_blocks_free(engine)


def engine_outputs_tail(tail, full):
    return full[len(full) - len(tail) :] == tail and len(tail) > 0


def test_finish_reasons_stop_token_eos_and_length(model):
    prompt = list(range(5, 25))
    full = generate(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)  # the first time it is sampled
    engine = make_engine(model)
    engine.add_request("len", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("stop", prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_token,)))
    finals, outputs = {}, {}
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert finals["len"].finish_reason == "length" and outputs["len"] == full.token_ids
    assert finals["stop"].finish_reason == "stop" and finals["stop"].stop_reason == stop_token
    assert outputs["stop"] == full.token_ids[:first]  # the stop token is not in the output
    # EOS given explicitly (a tokenizer's, say): make the first greedy token an EOS id
    engine = make_engine(model, eos_token_ids=[full.token_ids[0]])
    engine.add_request("eos", prompt, SamplingParams(max_tokens=5))
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs[0].finished and outs[0].finish_reason == "stop" and outs[0].new_token_ids == []
    # min_tokens: the EOS cannot be sampled before it; the output differs from greedy only there
    engine.add_request("min", prompt, SamplingParams(max_tokens=3, min_tokens=2))
    got = engine.run_to_completion()["min"]
    assert len(got) >= 2 and full.token_ids[0] not in got[:2]


def test_stop_strings_are_refused_by_the_tokens_only_engine(model):
    engine = make_engine(model)
    with pytest.raises(UserError, match="stop strings"):
        engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)))
    assert not engine.has_work


def test_engine_stream_cut_by_the_frontend_matches_generate(model):
    """The gateway's path: engine tokens -> RequestDetokenizer -> abort at the stop string."""
    from pagedweight.frontend.detokenizer import RequestDetokenizer

    tokenizer = Tokenizer(BUNDLED_MODEL)
    prompt = tokenizer.encode("And the LORD spake unto Moses")
    full = generate(model, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    full_text = tokenizer.decode(full.token_ids)
    stop = full_text[10:14]
    engine = make_engine(model)
    engine.add_request("stop", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    detok, streamed = RequestDetokenizer(tokenizer, prompt, stop=[stop]), ""
    while engine.has_work:
        for out in engine.step():
            delta = detok.push(out.new_token_ids)
            streamed += delta.text
            if delta.stopped:
                engine.abort("stop")
    assert detok.stopped and streamed == full_text[: full_text.find(stop)]
    assert_all_blocks_free(engine)


def test_requests_that_cannot_fit_are_refused_at_once(model):
    engine = make_engine(model, num_blocks=4)  # 16 tokens of KV
    with pytest.raises(ContextLengthError):
        engine.add_request("big", list(range(1, 12)), SamplingParams(max_tokens=6))
    with pytest.raises(ContextLengthError):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(UserError):
        engine.add_request("vocab", [model.config.vocab_size], SamplingParams())
    engine.add_request("ok", [1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(UserError):
        engine.add_request("ok", [1, 2], SamplingParams(max_tokens=3))


def test_seeded_sampling_is_reproducible_across_preemption(model, requests):
    prompts, _, _ = requests
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    roomy = run_all(make_engine(model), prompts[:6], params)
    tight_engine = make_engine(model, num_blocks=16, token_budget=24)
    tight = run_all(tight_engine, prompts[:6], params)
    assert roomy == tight


def test_first_output_carries_the_queue_time_and_later_ones_do_not(model):
    """vllm:request_queue_time_seconds comes from here: arrival to first scheduled, once per
    request. With one sequence at a time, the second request waits for the whole first."""
    engine = make_engine(model, max_seqs=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    queue_times: dict[str, list[float]] = {"a": [], "b": []}
    while engine.has_work:
        for out in engine.step():
            if out.queue_time_s is not None:
                queue_times[out.request_id].append(out.queue_time_s)
    assert [len(v) for v in queue_times.values()] == [1, 1]
    assert 0.0 <= queue_times["a"][0] < queue_times["b"][0]
