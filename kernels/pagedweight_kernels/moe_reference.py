"""The reference MoE combine in plain torch: group tokens by expert, run, weight, scatter-add.

The model's dense experts, the paged experts and the fused kernel's torch reference all
compute a layer through `moe_forward`, so there is one definition of what a MoE layer's
routed experts return, and every expert's activation goes through `gated`, so there is one
definition of each activation. Shape legend: T tokens, H hidden, k top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The experts' activation, by the name ModelConfig.expert_activation uses: act(gate) * up.
# "gelu_tanh" is GELU's tanh approximation (transformers' gelu_pytorch_tanh, Gemma-4's).
ACTIVATIONS = ("silu", "gelu_tanh")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert activation {activation!r} is not one of {ACTIVATIONS}")


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up, the gated experts' intermediate activation."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    check_activation(activation)
    raise AssertionError("unreachable")


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
