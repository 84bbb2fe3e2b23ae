"""The reference MoE combine in plain torch: group tokens by expert, run, weight, scatter-add.

The model's dense experts, the paged experts and the fused kernel's torch reference all
compute a layer through `moe_forward`, so there is one definition of what a MoE layer's
routed experts return. Shape legend: T tokens, H hidden, k top-k.
"""

from __future__ import annotations

import torch


def group_tokens_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Sort the (token, slot) pairs by expert.

    Returns (order, counts): `order` indexes the flattened [T*k] assignments sorted by
    expert id; counts[e] is how many assignments expert e received.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def expert_groups(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Yield (expert, token indices [n], routing weights [n]) for every expert with tokens."""
    k = topk_ids.shape[1]
    order, counts = group_tokens_by_expert(topk_ids, num_experts)
    token_of = order // k
    weights = topk_weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            yield e, token_of[start : start + n], weights[start : start + n]
        start += n


def moe_forward(x, topk_ids, topk_weights, expert_fn, num_experts: int) -> torch.Tensor:
    """Reference MoE combine: run each expert on its tokens, weight, scatter-add.

    `expert_fn(e, tokens [n, H]) -> [n, H]` computes one expert; only experts that
    received tokens are called.
    """
    out = torch.zeros_like(x)
    for e, tokens, weights in expert_groups(topk_ids, topk_weights, num_experts):
        y = expert_fn(e, x[tokens]) * weights[:, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
