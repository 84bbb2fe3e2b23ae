"""Perplexity refuses what would otherwise be a traceback or a NaN printed as a result."""

from __future__ import annotations

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.model import load_model
from pagedweight.offline.perplexity import NonFiniteResult, perplexity
from tests.conftest import BUNDLED_MODEL


@pytest.fixture(scope="module")
def model():
    return load_model(BUNDLED_MODEL, dtype=torch.float32)


def test_token_ids_outside_the_vocabulary_are_a_user_error(model):
    with pytest.raises(UserError, match="outside the model's vocabulary of 4096"):
        perplexity(model, [1, 2, 4096, 3], seq_len=4)


def test_overflowing_logits_are_an_error_not_nan(model):
    lm_head = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.fill_(3e38)
        with pytest.raises(NonFiniteResult, match="not a finite number"):
            perplexity(model, list(range(1, 20)), seq_len=8)
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(lm_head)
    assert perplexity(model, list(range(1, 20)), seq_len=8).ppl > 1.0
