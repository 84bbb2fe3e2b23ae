import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.model import load_model
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL


def test_kv_cache_decoding_equals_full_recompute():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    tokenizer = Tokenizer(BUNDLED_MODEL)
    prompt = tokenizer.encode("And the LORD spake unto Moses")
    out = generate(model, prompt, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_generate_is_tokens_only():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    with pytest.raises(UserError, match="stop strings"):
        generate(model, [1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)))
    full = generate(model, [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    stop_token = full.token_ids[2]
    cut = generate(model, [1, 2, 3], SamplingParams(max_tokens=6, stop_token_ids=(stop_token,)))
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: full.token_ids.index(stop_token)]
