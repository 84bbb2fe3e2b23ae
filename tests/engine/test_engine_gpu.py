"""The engine on CUDA (`make test-gpu`): both attention paths, and the arena runtime."""

from __future__ import annotations

import pytest
import torch

from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from tests.conftest import BUNDLED_MODEL
from tests.engine.replay_check import compare_replays_with_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("impl", ["reference", "batched", "inplace"])
@pytest.mark.parametrize("num_blocks", [1024, 16])  # 16: preemption and chunked prefill
def test_engine_on_cuda_equals_generate(impl, num_blocks):
    model = load_model(BUNDLED_MODEL, dtype=torch.float32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in (3, 17, 33, 5, 29, 12)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [generate(model, p, params).token_ids for p in prompts]
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
        kv=KVCacheConfig(block_size=4), attention_impl=impl, num_kv_blocks=num_blocks,
    )
    engine = Engine(model, config=config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = engine.run_to_completion()
    assert [out[str(i)] for i in range(len(prompts))] == expected
    assert engine.kv.manager.num_used_blocks == 0


def test_dynamic_runtime_on_cuda_stays_in_budget(paged_micro_dir):
    from pagedweight.runtime import RuntimeConfig, build_runtime
    from tests.test_runtime import ENGINE, check_pool, fixed_budget, prompts

    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=80)
    runtime = build_runtime(
        paged_micro_dir, RuntimeConfig(budget, "pagedweight", device="cuda", engine=ENGINE)
    )
    try:
        engine = runtime.engine
        for i, p in enumerate(prompts()):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
        done = 0
        while engine.has_work:
            done += sum(out.finished for out in engine.step())
            check_pool(runtime)
        assert done == len(prompts()) and engine.stats().memory_requests > 0
    finally:
        runtime.close()


@pytest.mark.parametrize("policy", ["static-4", "static-8"])
def test_static_runtime_replays_compute_the_eager_step(paged_micro_dir, policy):
    """The fused kernel's layers through captured graphs, prefill chunks and mixed steps as
    token rows included: every replayed step's logits against the same step run eagerly right
    after it (it rewrites the same KV values). The bf16 engine holds this in
    test_decode_graphs.py; here the experts are the APL kernel's launches a capture bakes in."""
    from pagedweight.runtime import RuntimeConfig, build_runtime
    from tests.test_runtime import ENGINE, fixed_budget, prompts

    budget = fixed_budget(paged_micro_dir, 8, kv_tokens=400)
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, policy, device="cuda", engine=ENGINE))
    try:
        engine = runtime.engine
        runner = engine.runner
        assert runner.graphs is not None
        checked = compare_replays_with_eager(runner, engine.model)
        for i, p in enumerate(prompts()):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
        engine.run_to_completion()
        assert checked and any(rows > n for n, rows, _, _ in checked)  # prefill rows replayed too
        # as the bf16 test: decode steps run the same kernels as the eager step; steps with
        # prefill rows take the decode kernel's attention against SDPA, which rounds differently
        assert all(rel < (1e-2 if rows == n else 4e-2) and same >= 0.99 for n, rows, rel, same in checked), checked
    finally:
        runtime.close()
