"""The runtime's experts operator on CUDA: the fused kernel reads the arena in place and
follows every commit (`make test-gpu`)."""

from __future__ import annotations

import time

import pytest
import torch

from pagedweight.engine.engine import EngineConfig
from pagedweight.runtime import RuntimeConfig, build_runtime
from pagedweight.weights.arena_experts import ArenaExperts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def layer_inputs(model, ids) -> dict[int, tuple]:
    """Each MoE layer's real inputs (x, topk_ids, topk_weights) in a bf16 forward."""
    captured = {}
    for moe in model.moe_blocks:
        moe.observer = lambda layer, x, i, w: captured.__setitem__(layer, (x.clone(), i.clone(), w.clone()))
    with torch.inference_mode():
        model(ids)
    for moe in model.moe_blocks:
        moe.observer = None
    return captured


def assert_kernel_within_bf16_bounds(model, ids):
    """Per layer, on the layer's real inputs: the kernel (bf16 in, fp32 accumulation) is at
    least as close to an fp32 computation at the same committed bits as the bf16 torch
    reference path is. (Per layer, not on logits: through a whole 4-bit model two bf16
    paths drift apart chaotically, and neither is then a sound judge of the other.)"""
    for layer, (x, topk_ids, topk_weights) in layer_inputs(model, ids).items():
        op = model.moe_blocks[layer].experts
        assert isinstance(op, ArenaExperts) and op.use_kernel
        with torch.inference_mode():
            op.use_kernel = False
            exact = op(x.float(), topk_ids, topk_weights.float())
            reference = op(x, topk_ids, topk_weights)
            op.use_kernel = True
            kernel = op(x, topk_ids, topk_weights)
        err_kernel = ((kernel.float() - exact).norm() / exact.norm()).item()
        err_reference = ((reference.float() - exact).norm() / exact.norm()).item()
        assert err_kernel <= 1.25 * err_reference + 1e-3, (layer, err_kernel, err_reference)


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
