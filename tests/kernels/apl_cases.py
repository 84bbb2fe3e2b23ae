"""Layers and routings shared by the kernel tests (CPU and GPU)."""

from __future__ import annotations

import torch

from pagedweight_kernels.apl_moe import APLLayer
from pagedweight_kernels.synthetic import random_block
from pagedweight.model.apl_experts import resident_block


def mixed_bits(num_experts: int) -> dict[tuple[int, str], int]:
    """# (expert, module) -> bits, every width 3..8 present once there are >= 3 experts."""
    return {(e, m): 3 + (2 * e + i) % 6 for e in range(num_experts) for i, m in enumerate(("gate_up", "down"))}


def random_layer(num_experts, hidden, intermediate, seed=0, device="cpu", bits=None) -> APLLayer:
    gen = torch.Generator().manual_seed(seed)
    bits = bits or mixed_bits(num_experts)
    gate_up = [resident_block(random_block(2 * intermediate, hidden, gen, device), bits[(e, "gate_up")], device)
               for e in range(num_experts)]
    down = [resident_block(random_block(hidden, intermediate, gen, device), bits[(e, "down")], device)
            for e in range(num_experts)]
    return APLLayer(gate_up, down)


def ragged_routing(num_tokens, num_experts, top_k, seed=0, num_used=None, device="cpu"):
    """Top-k routing over only `num_used` experts (the rest get no tokens), skewed so one
    expert is hot; weights normalised like Mixtral's."""
    gen = torch.Generator().manual_seed(seed)
    num_used = num_used or num_experts
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 2.0  # a hot expert
    logits[:, num_used:] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)
