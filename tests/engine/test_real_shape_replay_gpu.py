"""Seed models at their real layer shapes (two layers, random weights) through the static
runtime's captured graphs: each replayed step against the same step run eagerly, and a
prompt's prefill logits against transformers' bf16 model of the same weights (GPU).

The micro models of test_engine_gpu.py never reach what only the real sizes do: Mixtral's
grouped-query attention at 32 heads over 8, its 14336-wide experts whose 32-row prefill takes
the tiles regime, Qwen1.5-MoE's 60 experts with a shared one. A replayed prefill step must
compute what the eager step computes; at 8 bits both stay near transformers' bf16 logits.
"""

from __future__ import annotations

import pytest
import torch

from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.offline.real_shape_models import build_hf_model, logit_error, paged_by_layer
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = 2
PROMPTS = (32, 33, 7)  # one step each: a tiles-regime prefill on Mixtral, one row more, a decode-sized one
GiB = 1 << 30


@pytest.fixture(scope="module", params=["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def real_shape(request):
    """(paged artifact, transformers' bf16 model of the same seeded weights) at two layers."""
    device, overrides = torch.device("cuda"), {"num_hidden_layers": LAYERS}
    paged, _ = paged_by_layer(request.param, device, torch.bfloat16, seed=0, overrides=overrides, log=lambda _: None)
    hf_model, _ = build_hf_model(request.param, device, torch.bfloat16, overrides, seed=0)
    yield paged, hf_model
    del hf_model
    torch.cuda.empty_cache()


def replays_and_eager(runner, model) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Wrap runner._replay: per replayed step (token rows, replayed logits, the same step's
    logits run eagerly right after it, which rewrites the same KV values)."""
    replay, steps = runner._replay, []

    def replay_and_eager(scheduled):
        replayed = replay(scheduled)
        if replayed is not None:
            logits = replayed[0].float().clone()
            ids, step, rows = runner.prepare(scheduled)
            eager = model.forward_paged(ids, step, rows).float()
            steps.append((sum(s.num_new_tokens for s in scheduled), logits, eager))
        return replayed

    runner._replay = replay_and_eager
    return steps


@pytest.mark.parametrize("policy", ["static-8", "static-4"])
def test_real_shape_replays_compute_the_eager_step(real_shape, policy):
    paged, hf_model = real_shape
    engine_config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                                 kv=KVCacheConfig(), num_kv_blocks=256)
    experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in paged.meta["blocks"])
    dense = sum(v.numel() * v.element_size() for v in paged.dense_state.values())
    budget = dense + workspace_bytes(paged.config, engine_config, torch.bfloat16) + experts8 + GiB
    runtime = build_runtime_from_paged(paged, RuntimeConfig(budget, policy, device="cuda", dtype=torch.bfloat16,
                                                            engine=engine_config))
    try:
        engine = runtime.engine
        assert engine.runner.graphs is not None and engine.runner.graph_prefill
        steps = replays_and_eager(engine.runner, engine.model)
        vocab = paged.config.vocab_size
        gen = torch.Generator().manual_seed(17)
        prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPTS]
        prefill_logits = []
        for i, prompt in enumerate(prompts):
            first = len(steps)
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, ignore_eos=True))
            engine.run_to_completion()
            assert len(steps) > first and steps[first][0] == len(prompt)  # the prefill was replayed
            prefill_logits.append(steps[first][1:])
        errors = [(rows, logit_error(replayed, eager)) for rows, replayed, eager in steps]
        print(policy, "replayed against eager (rows, error):", errors)
        with torch.inference_mode():
            reference = [hf_model(torch.tensor([p], device="cuda")).logits[0, -1].float() for p in prompts]
        against_hf = [(logit_error(r[None], ref[None]), logit_error(e[None], ref[None]))
                      for (r, e), ref in zip(prefill_logits, reference)]
        print(policy, "prefill against transformers bf16 (replayed, eager):", against_hf)
        for rows, error in errors:
            assert error["relative_error_max"] < 4e-2 and error["argmax_agree"] == 1.0, (rows, error)
        if policy == "static-8":
            for replayed, eager in against_hf:
                assert replayed["relative_error_max"] < 0.1 and eager["relative_error_max"] < 0.1, against_hf
    finally:
        runtime.close()
