import torch

from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.model import load_model
from pagedweight.model.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL


def test_kv_cache_decoding_equals_full_recompute():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    tokenizer = Tokenizer(BUNDLED_MODEL)
    prompt = tokenizer.encode("And the LORD spake unto Moses")
    out = generate(model, tokenizer, prompt, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_stop_string_cuts_text_and_reports_stop():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    tokenizer = Tokenizer(BUNDLED_MODEL)
    prompt = tokenizer.encode("And the LORD spake unto Moses")
    full = generate(model, tokenizer, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.text[10:14]
    cut = generate(model, tokenizer, prompt, SamplingParams(max_tokens=30, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


def test_chat_template_renders_messages():
    tokenizer = Tokenizer(BUNDLED_MODEL)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in text and text != "hi"
