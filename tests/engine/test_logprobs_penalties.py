"""Logprobs, presence/frequency/repetition penalties and logit_bias as vLLM defines them:
the formulas on a hand-made row, and the engine end to end on the bundled micro model
(its returned logprobs equal a plain forward's log_softmax)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.sampler import SamplingParams, apply_penalties
from tests.engine.test_engine import make_engine, model  # noqa: F401  (the module fixture)


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias=((4, -10.0),))
    out = apply_penalties(logits.clone(), params, prompt_ids=[1], output_ids=[0, 0, 2])
    # bias first; repetition over prompt+output tokens (0, 1, 2): positive / 2, negative * 2;
    # frequency 0.5 x count and presence 0.25 once, over output tokens (0 twice, 2 once)
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0, 1.0 - 10.0]
    assert out[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("kwargs", [{"logprobs": 21}, {"presence_penalty": 2.5}, {"frequency_penalty": -3},
                                    {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)}])
def test_out_of_range_values_are_refused(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_logprobs_are_the_raw_log_softmax_of_each_sampled_token(model):  # noqa: F811
    engine = make_engine(model)
    prompt = [5, 17, 42, 8]
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=3))
    outputs = []
    while engine.has_work:
        outputs += [o for o in engine.step() if o.new_token_ids]
    tokens = [o.new_token_ids[0] for o in outputs]
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens])
        expected = model(ids)[0].float().log_softmax(-1)  # [T, V]
    for step, out in enumerate(outputs):
        (logprob, top_ids, top_logprobs), = out.logprobs
        row = expected[len(prompt) - 1 + step]
        assert logprob == pytest.approx(row[tokens[step]].item(), abs=1e-4)
        assert top_ids == row.topk(3).indices.tolist()
        assert top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert top_ids[0] == tokens[step]  # greedy: the sampled token is the most likely
        assert math.isclose(sum(math.exp(v) for v in row.tolist()), 1.0, rel_tol=1e-3)


def test_logit_bias_and_frequency_penalty_change_what_greedy_picks(model):  # noqa: F811
    prompt = [5, 17, 42, 8]

    def run(**kw):
        engine = make_engine(model)
        engine.add_request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True, **kw))
        return engine.run_to_completion()["r"]

    plain = run()
    assert run(logit_bias=((7, 100.0),)) == [7] * 6  # a +100 bias wins every step
    penalised = run(frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalised)) >= len(set(plain))
    assert penalised != plain or len(set(plain)) == 6  # repeats get pushed down
