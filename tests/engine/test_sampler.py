import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.sampler import SamplingParams, sample


def draws(logits, params, n=2000):
    gen = torch.Generator().manual_seed(0)
    return torch.stack([sample(logits, params, gen) for _ in range(n)])


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 0.0]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 0]


def test_top_k_only_draws_the_k_best():
    logits = torch.tensor([[1.0, 1.1, 0.9, 3.0, 2.9]])
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_k=2)).flatten().tolist())
    assert seen == {3, 4}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seen = set(draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.75)).flatten().tolist())
    assert seen == {0, 1}  # 0.5 < 0.75 needs the second token; 0.8 >= 0.75 stops there


def test_seed_fixes_the_draws():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=3)
    a = draws(logits, params, 50)
    b = draws(logits, params, 50)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 1.5},
                                    {"top_k": -2}, {"stop": ("",)},
                                    {"min_tokens": 20, "max_tokens": 10}, {"min_tokens": -1},
                                    {"stop_token_ids": (-1,)}])
def test_invalid_params_raise(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


