"""Qwen3-MoE (with and without a sliding window), OLMoE and Gemma-4 MoE against `transformers`: logits,
64-token greedy decoding on the contiguous path and through the paged-KV engine (both
attention paths), for both checkpoint layouts."""

from __future__ import annotations

import copy

import pytest
import torch

from pagedweight.common.errors import UnsupportedModelError
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from tests.model.families import FAMILIES, LAYOUTS, config_dict, reference_model, write_checkpoint

NEW_TOKENS = 64
PROMPT_LENS = (7, 19)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, {layout: our model loaded from that layout})."""
    name = request.param
    reference = reference_model(name)
    ours = {}
    for layout in LAYOUTS:
        ckpt = write_checkpoint(reference, tmp_path_factory.mktemp(f"{name}_{layout}"), layout)
        ours[layout] = load_model(ckpt, dtype=torch.float32)
    return name, reference, ours


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def reference_greedy(reference, prompt: list[int]) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    # Greedy equality is only a fair test where the reference's choice is not a near-tie that
    # fp32 rounding order may flip (our logits match to ~3e-6).
    margin = min(s[0].topk(2).values.diff().abs().item() for s in out.scores)
    assert margin > 1e-4, f"reference top-2 logits {margin} apart: choose another seed"
    return out.sequences[0, len(prompt):].tolist()


@torch.inference_mode()
def test_both_layouts_load_the_same_weights(family):
    _, _, ours = family
    fused, split = (ours[layout].state_dict() for layout in LAYOUTS)
    assert fused.keys() == split.keys()
    assert all(torch.equal(fused[k], split[k]) for k in fused)


@torch.inference_mode()
def test_logits_match_transformers(family):
    name, reference, ours = family
    ids = torch.randint(0, reference.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    expected = reference(ids).logits
    assert expected.std() > 0.5, "random weights too flat for a meaningful comparison"
    for layout, model in ours.items():
        diff = (model(ids) - expected).abs().max().item()
        assert diff < 1e-4, f"{name}/{layout}: max-abs logit difference {diff}"


@torch.inference_mode()
def test_fused_projections_keep_the_logits_of_every_family(family):
    """What the engine does to a model on CUDA (fuse q/k/v, ask for the shared-expert side
    stream) runs on every family's blocks (Gemma-4's routed block has no shared expert: the
    side-stream request once raised AttributeError on it) and changes no logit."""
    name, reference, ours = family
    model = copy.deepcopy(ours["fused"])
    model.fuse_projections(overlap_shared_experts=True)
    assert not model.fused_kernels  # on the CPU
    ids = torch.randint(0, reference.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(2))
    diff = (model(ids) - reference(ids).logits).abs().max().item()
    assert diff < 1e-4, f"{name}: fused projections moved a logit by {diff}"


@torch.inference_mode()
def test_greedy_contiguous_and_paged_engine_match_transformers(family):
    name, reference, ours = family
    model = ours["fused"]
    requests = prompts(model.config.vocab_size)
    expected = [reference_greedy(reference, p) for p in requests]
    assert len({tuple(e) for e in expected}) == len(expected), "degenerate model: every prompt decodes alike"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [generate(model, p, params).token_ids for p in requests] == expected, f"{name}: contiguous path"
    for impl in ("reference", "batched", "inplace"):
        # a small cache and token budget: chunked prefill and preemption go through paged KV too
        engine = Engine(model, config=EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            kv=KVCacheConfig(block_size=4), attention_impl=impl, num_kv_blocks=48,
        ))
        for i, p in enumerate(requests):
            engine.add_request(str(i), p, params)
        out, most_live = {}, 0  # most blocks one sequence held after a step
        while engine.has_work:
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            most_live = max([most_live] + [len([b for b in s.block_ids if b >= 0]) for s in engine.scheduler.running])
        assert [out[str(i)] for i in range(len(requests))] == expected, f"{name}: paged engine ({impl})"
        assert engine.kv.manager.num_used_blocks == 0
        window = model.config.kv_window
        if window is not None:  # blocks behind every window were given back as decoding went on
            bs, chunk = engine.kv.block_size, engine.scheduler.config.max_num_batched_tokens
            assert most_live <= -(-(window - 1 + chunk) // bs) + 1, most_live
            assert most_live < -(-(max(PROMPT_LENS) + NEW_TOKENS) // bs)


@pytest.mark.parametrize("family_name, field, value", [
    ("qwen3_moe_window", "max_window_layers", 1),
    ("qwen3_moe", "mlp_only_layers", [0]),
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "hidden_act", "gelu"),
    ("olmoe", "hidden_act", "relu"),
])
def test_unsupported_switches_are_refused_naming_the_field(family_name, field, value):
    raw = config_dict(family_name)
    ModelConfig.from_dict(raw)  # the unmodified config parses
    raw[field] = value
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


def test_config_fields_of_each_family():
    qwen3 = ModelConfig.from_dict(config_dict("qwen3_moe"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.norm_topk_prob, qwen3.attention_bias, qwen3.o_proj_bias) == (
        "head", 24, True, True, True)
    assert qwen3.expert_intermediate_size == 32 and qwen3.shared_expert_intermediate_size == 0
    olmoe = ModelConfig.from_dict(config_dict("olmoe"))
    assert (olmoe.qk_norm, olmoe.num_experts, olmoe.num_experts_per_tok, olmoe.norm_topk_prob) == (
        "full", 64, 8, False)
    assert olmoe.head_dim == 16 and olmoe.expert_intermediate_size == 32
    assert qwen3.sliding_window is None and olmoe.sliding_window is None
    windowed = ModelConfig.from_dict(config_dict("qwen3_moe_window"))
    assert [windowed.layer_window(i) for i in range(windowed.num_layers)] == [6, 6]
