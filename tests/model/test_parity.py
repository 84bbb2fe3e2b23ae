"""Our model against Hugging Face `transformers`: logits and greedy generation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.model import load_model
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import domain_prompts, shared_model_dirs

MODELS = shared_model_dirs()


@pytest.fixture(scope="module", params=MODELS, ids=[p.name for p in MODELS])
def model_pair(request):
    model_dir = request.param
    ours = load_model(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, ours, reference


@torch.inference_mode()
def test_logits_match_transformers(model_pair):
    model_dir, ours, reference = model_pair
    tokenizer = Tokenizer(model_dir)
    for domain, prompt in domain_prompts().items():
        ids = torch.tensor([tokenizer.encode(prompt)])
        diff = (ours(ids) - reference(ids).logits).abs().max().item()
        assert diff < 1e-4, f"{model_dir.name}/{domain}: max-abs logit difference {diff}"


@torch.inference_mode()
def test_batched_random_tokens_match_transformers(model_pair):
    _, ours, reference = model_pair
    ids = torch.randint(0, ours.config.vocab_size, (3, 41), generator=torch.Generator().manual_seed(0))
    assert (ours(ids) - reference(ids).logits).abs().max().item() < 1e-4


@torch.inference_mode()
def test_greedy_generation_matches_transformers(model_pair):
    model_dir, ours, reference = model_pair
    tokenizer = Tokenizer(model_dir)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for domain, prompt in domain_prompts().items():
        prompt_ids = tokenizer.encode(prompt)
        expected = reference.generate(
            torch.tensor([prompt_ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
            pad_token_id=0,
        )[0, len(prompt_ids):].tolist()
        got = generate(ours, prompt_ids, params).token_ids
        assert got == expected, f"{model_dir.name}/{domain}: greedy tokens differ"
