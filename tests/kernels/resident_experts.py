"""A test-only experts operator over resident APL blocks (no arena, no pager).

The kernel's tests run a model's MoE blocks through the kernel on blocks placed anywhere,
without a worker runtime. The serving path uses one operator
over the memory arena (`pagedweight.weights.arena_experts.ArenaExperts`) and the
dequantising reference (`pagedweight.model.dequantized_experts`).

Same call as DenseExperts, `experts(x [T, H], topk_ids [T, k], topk_weights [T, k])`; the
model never sees the storage. On CUDA (bf16/fp16 activations, cupy present) it runs the
fused kernel (kernels/pagedweight_kernels/apl_moe.cu), elsewhere the torch reference; both read the same
planes and LUTs. The runtime's page table commits a new bit-width for a block with
`commit_block`, which only rewrites that block's descriptor row.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedweight_kernels.apl_moe import ACT_DTYPES, APLLayer, ResidentBlock, apl_moe, apl_moe_reference, kernel_available
from pagedweight.format.apl_format import APLBlock
from pagedweight_kernels.layer import resident_block


class APLExperts(nn.Module):
    def __init__(self, layer: APLLayer, use_kernel: bool | None = None):
        super().__init__()
        self.layer = layer
        self.num_experts = layer.num_experts
        # None: the kernel wherever it can run.
        self.use_kernel = kernel_available() if use_kernel is None else use_kernel

    @classmethod
    def from_blocks(cls, gate_up: list[APLBlock], down: list[APLBlock],
                    bits: dict[tuple[int, str], int], device, use_kernel: bool | None = None,
                    activation: str = "silu") -> "APLExperts":
        """bits: # (expert, module) -> committed bit-width; activation: moe_reference.ACTIVATIONS."""
        layer = APLLayer(
            [resident_block(b, bits[(e, "gate_up")], device) for e, b in enumerate(gate_up)],
            [resident_block(b, bits[(e, "down")], device) for e, b in enumerate(down)],
            activation,
        )
        return cls(layer, use_kernel)

    def commit_block(self, expert: int, module: str, block: ResidentBlock):
        """Make the kernels read `block` (new bits, planes anywhere) from the next call on."""
        self.layer.set_block(expert, module, block)

    def forward(self, x, topk_ids, topk_weights):
        if self.use_kernel and x.is_cuda and x.dtype in ACT_DTYPES:
            return apl_moe(x.contiguous(), topk_ids, topk_weights, self.layer)
        return apl_moe_reference(x, topk_ids, topk_weights, self.layer)
