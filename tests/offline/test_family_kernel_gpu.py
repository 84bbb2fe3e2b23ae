"""Qwen3-MoE, OLMoE and Gemma-4 MoE (GELU-tanh experts) on the fused kernel path (`make test-gpu`): quantised by the offline
pipeline, served from the arena on CUDA in bf16, the kernel's per-layer output within bf16
bounds of an fp32 computation at the same bits, and the paged engine decoding every request
to its length through the kernel. (Greedy tokens are not compared with single-stream
decoding here: in bf16 the kernel's batched and one-token launches round differently, and a
random tiny model's near-ties then pick different tokens; the per-layer bound is the judge.)"""

from __future__ import annotations

import pytest
import torch

from pagedweight.engine.engine import EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.runtime import RuntimeConfig, build_runtime
from tests.model.families import PIPELINE_FAMILIES, reference_model, write_checkpoint
from tests.offline.conftest import quick_config
from tests.weights.test_arena_kernel_gpu import assert_kernel_within_bf16_bounds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=list(PIPELINE_FAMILIES))
def paged_dir(request, tmp_path_factory, calib_files):
    from pagedweight.offline.quantize import quantize_model

    name = request.param
    ckpt = write_checkpoint(reference_model(name).to(torch.bfloat16), tmp_path_factory.mktemp(name), "per_expert")
    return quantize_model(ckpt, tmp_path_factory.mktemp(f"{name}_paged") / name, calib_files, quick_config())


@pytest.mark.parametrize("policy", ["static-8", "static-4", "static-3"])
def test_fused_kernel_serves_the_family(paged_dir, policy):
    runtime = build_runtime(paged_dir, RuntimeConfig(256 << 20, policy, device="cuda", dtype=torch.bfloat16,
                                                     engine=EngineConfig()))
    try:
        model = runtime.engine.model
        vocab = model.config.vocab_size
        ids = torch.randint(3, vocab, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        assert_kernel_within_bf16_bounds(model, ids)
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 27, 13)]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        engine = runtime.engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out = engine.run_to_completion()
        assert [len(out[str(i)]) for i in range(len(prompts))] == [params.max_tokens] * len(prompts)
        assert engine.kv.manager.num_used_blocks == 0
        assert len(generate(model, prompts[0], params).token_ids) == params.max_tokens
    finally:
        runtime.close()
