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


def logits_both_paths(model, ids):
    """Logits with the kernel and with the torch reference, same committed bits."""
    experts = [moe.experts for moe in model.moe_blocks]
    assert all(isinstance(e, ArenaExperts) and e.use_kernel for e in experts)
    with torch.inference_mode():
        kernel = model(ids).float()
        for e in experts:
            e.use_kernel = False
        reference = model(ids).float()
        for e in experts:
            e.use_kernel = True
    return kernel, reference


def assert_close_bf16(kernel, reference):
    rel = (kernel - reference).norm() / reference.norm()
    assert rel < 2e-2, f"kernel vs reference relative error {rel:.4f}"
    assert (kernel.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95


def test_kernel_follows_the_page_table_while_bits_move(paged_micro_dir):
    config = RuntimeConfig(64 << 20, "pagedweight", device="cuda", dtype=torch.bfloat16,
                           engine=EngineConfig())
    runtime = build_runtime(paged_micro_dir, config)
    try:
        model = runtime.engine.model
        ids = torch.randint(1, 4096, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        assert_close_bf16(*logits_both_paths(model, ids))
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
        kernel, reference = logits_both_paths(model, ids)
        assert_close_bf16(kernel, reference)
        # The kernel computes at the new bits: its output moved with the reference's.
        layer = model.moe_blocks[0].experts.kernel_layer()
        assert [b.bits for b in layer.gate_up] == [
            after[bid] for bid in sorted(after) if bid.layer == 0 and bid.module == "gate_up"
        ]
    finally:
        runtime.close()
