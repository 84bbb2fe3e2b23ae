"""Every generated configuration (parity_cases.CASES) against `transformers` in fp32:
teacher-forced logits within 1e-4 relative error, 32 greedy tokens identical on our
contiguous path, and the text `pagedweight generate --dtype float32 --temperature 0`
prints identical to what `transformers`' tokenizer decodes of its own greedy tokens.
Configurations we do not run (parity_cases.REFUSED) and fields unknown to us are refused
at load naming the field."""

from __future__ import annotations

import pytest
import torch

from pagedweight.cli.main import main as cli_main
from pagedweight.common.errors import UnsupportedModelError
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.format.config_fields import inert_fields
from pagedweight.format.model_config import ModelConfig
from pagedweight.model import load_model
from tests.model.families import save_with_tokenizer
from tests.model.parity_cases import BASES, CASES, REFUSED, config_dict, reference_model

NEW_TOKENS = 32
MAX_REL_ERROR = 1e-4
# Greedy equality is a fair test only where the reference's choice is no near-tie that fp32
# rounding order may flip (our logits match to ~1e-6 relative).
MIN_MARGIN = 1e-4
PROMPT = "In the beginning God created the heaven and the earth. def main(argv):"
CLI_CASES = [f"{family}-base" for family in BASES] + [
    "mixtral-sliding-window", "qwen2_moe-window-layers", "qwen3_moe-rope-yarn", "olmoe-clip-qkv",
    "qwen2_moe-gelu-tanh", "gemma4_moe-k-eq-v"]


# one intra-op thread while this module runs (tests/conftest.py: one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def case(request, tmp_path_factory):
    """(case, transformers model, checkpoint dir, our model)."""
    reference = reference_model(request.param)
    ckpt = save_with_tokenizer(reference, tmp_path_factory.mktemp(request.param.id))
    return request.param, reference, ckpt, load_model(ckpt, dtype=torch.float32)


def greedy_checked_by_reference(ours, reference, vocab: int) -> tuple[list[int], list[int], float]:
    """Our greedy tokens from the first of a few fixed random prompts whose path the reference
    passes with no near-tie, and the reference's own choice at every step of that path.

    transformers' greedy decoding picks the argmax of its logits for the sequence so far; teacher-
    forcing our tokens through it in one forward gives those argmaxes for every step at once,
    so the two texts are equal exactly when each of our tokens is the reference's argmax."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for length in (9, 17, 6, 23, 12):
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        got = generate(ours, prompt, params).token_ids
        logits = reference(torch.tensor([prompt + got[:-1]])).logits[0, length - 1:]
        top2 = logits.topk(2, dim=-1)
        if top2.values.diff(dim=-1).abs().min().item() > MIN_MARGIN:
            return got, top2.indices[:, 0].tolist(), length
    pytest.fail("every prompt's greedy path has a near-tie: choose another seed for this case")


@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(case):
    c, reference, _, ours = case
    ids = torch.randint(3, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = reference(ids).logits
    assert expected.std() > 0.5, "random weights too flat for a meaningful comparison"
    rel = ((ours(ids) - expected).abs().max() / expected.abs().max()).item()
    assert rel <= MAX_REL_ERROR, f"{c.id}: relative logit error {rel:.2e}"
    got, reference_choice, _ = greedy_checked_by_reference(ours, reference, ours.config.vocab_size)
    assert got == reference_choice, f"{c.id}: greedy tokens differ from step {_first_difference(got, reference_choice)}"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@pytest.mark.parametrize("case_id", CLI_CASES)
def test_generate_command_prints_transformers_text(case_id, tmp_path, capsys):
    """The user's path, on a case per family and each windowed, rescaled or clamped one:
    text in, text out, transformers' own greedy generate (EOS honoured on both sides)."""
    from transformers import AutoTokenizer

    reference = reference_model(next(c for c in CASES if c.id == case_id))
    ckpt = save_with_tokenizer(reference, tmp_path / case_id)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    code = cli_main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--dtype", "float32",
                     "--temperature", "0", "--max-tokens", str(NEW_TOKENS)])
    assert code == 0
    assert capsys.readouterr().out == expected + "\n", f"{case_id}: generated text differs"


@pytest.mark.parametrize("family, field, value", REFUSED, ids=[f"{f}-{k}" for f, k, _ in REFUSED])
def test_unimplemented_configurations_are_refused_naming_the_field(family, field, value):
    raw = config_dict(family)
    ModelConfig.from_dict(raw)  # the base configuration parses
    raw[field] = value
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("family", list(BASES))
def test_a_field_unknown_to_us_is_refused_naming_it(family):
    raw = config_dict(family)
    raw["attention_temperature_from_the_future"] = 0.5
    with pytest.raises(UnsupportedModelError, match="attention_temperature_from_the_future"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("family", list(BASES))
def test_every_field_transformers_writes_is_read_or_inert(family):
    """What the config class writes parses; and a field listed as inert changes nothing we
    build (each one flipped to another value leaves the parsed config as it was)."""
    raw = config_dict(family)
    parsed = ModelConfig.from_dict(raw)
    architecture = raw["architectures"][0]
    for key in sorted(inert_fields(architecture) & set(raw)):
        value = raw[key]
        other = {**raw, key: (not value) if isinstance(value, bool) else 0.37 if isinstance(value, float) else value}
        assert ModelConfig.from_dict(other) == parsed, key


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_legacy_rope_scaling_reads_as_transformers_reads_it(family):
    """Older config.json files keep `rope_theta` at top level and the scaling in `rope_scaling`
    (with `type` for `rope_type`); transformers folds both into rope_parameters."""
    import transformers

    modern = config_dict(family, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}})
    legacy = {k: v for k, v in modern.items() if k != "rope_parameters"}
    legacy.update(rope_theta=5000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    config_cls = getattr(transformers, BASES[family][1])
    standardized = config_cls(**{k: v for k, v in legacy.items() if k not in ("architectures", "model_type")})
    assert standardized.rope_parameters["rope_type"] == "yarn" and standardized.rope_parameters["rope_theta"] == 5000.0
    assert ModelConfig.from_dict(legacy) == ModelConfig.from_dict(modern)
    assert ModelConfig.from_dict(legacy).rope_scaling.rope_type == "yarn"
