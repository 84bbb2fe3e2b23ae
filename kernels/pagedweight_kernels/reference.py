"""apl_moe_reference: the fused MoE operator in plain torch. Each used block is dequantised by
`pagedweight.format.apl_format.dequantize` (the format's one definition) in x's dtype, and the
reference combine `moe_forward` runs the experts. Tests compare the kernels to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedweight_kernels.layer import APLLayer, ResidentBlock
from pagedweight_kernels.moe_reference import gated, moe_forward


def apl_moe_reference(x, topk_ids, topk_weights, layer: APLLayer, weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: dequantise each used block in x's dtype, reference combine.
    weight_dtype: dequantise in it instead (an fp32 reference of what a bf16 kernel reads)."""
    dtype = weight_dtype or (x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float16)

    def weights(block: ResidentBlock, tokens: torch.Tensor) -> torch.Tensor:
        return block.dequantize(dtype).to(tokens.device, tokens.dtype)

    def expert(e: int, tokens: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(tokens, weights(layer.gate_up[e], tokens)).chunk(2, dim=-1)
        return F.linear(gated(gate, up, layer.activation), weights(layer.down[e], tokens))

    return moe_forward(x, topk_ids, topk_weights, expert, layer.num_experts)
