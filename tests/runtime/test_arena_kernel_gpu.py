"""The runtime's experts operator on CUDA: the fused kernel reads the arena in place and
follows every commit (`make test-gpu`)."""

from __future__ import annotations

import time

import pytest
import torch

from services.worker.engine.engine import EngineConfig
from services.worker.runtime import RuntimeConfig, build_runtime
from services.worker.weights.arena_experts import ArenaExperts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def run(model, ids, use_kernel: bool) -> torch.Tensor:
    for moe in model.moe_blocks:
        moe.experts.use_kernel = use_kernel
    with torch.inference_mode():
        return model(ids).float()


def assert_kernel_within_bf16_bounds(model, ids):
    """The kernel (bf16 in, fp32 accumulation) is at least as close to an fp32 computation
    at the same committed bits as the bf16 torch reference path is."""
    assert all(isinstance(m.experts, ArenaExperts) and m.experts.use_kernel for m in model.moe_blocks)
    exact = run(model.float(), ids, use_kernel=False)  # fp32 everywhere, same bf16 weights
    model.to(torch.bfloat16)  # bf16 -> fp32 -> bf16 is exact
    reference = run(model, ids, use_kernel=False)
    kernel = run(model, ids, use_kernel=True)
    err_kernel = ((kernel - exact).norm() / exact.norm()).item()
    err_reference = ((reference - exact).norm() / exact.norm()).item()
    assert err_kernel <= 1.25 * err_reference + 1e-3, (err_kernel, err_reference)
    assert (kernel.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_kernel_follows_the_page_table_while_bits_move(paged_micro_dir):
    config = RuntimeConfig(64 << 20, "pagedweight", device="cuda", dtype=torch.bfloat16,
                           engine=EngineConfig())
    runtime = build_runtime(paged_micro_dir, config)
    try:
        model = runtime.engine.model
        ids = torch.randint(1, 4096, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        assert_kernel_within_bf16_bounds(model, ids)
        before = dict(runtime.table.committed_bits())

        # Lower bits through the pager, as KV pressure would, and let the moves commit.
        runtime.pager.request_bytes(2 << 20)
        for _ in range(200):
            runtime.pager.step_boundary()
            if not runtime.pager.busy():
                break
            time.sleep(0.005)
        after = runtime.table.committed_bits()
        assert any(after[b] < before[b] for b in before), "the pager lowered no block"
        assert_kernel_within_bf16_bounds(model, ids)
        # The kernel's descriptors show exactly the newly committed bits.
        layer = model.moe_blocks[0].experts.kernel_layer()
        assert [b.bits for b in layer.gate_up] == [
            after[bid] for bid in sorted(after) if bid.layer == 0 and bid.module == "gate_up"
        ]
    finally:
        runtime.close()
