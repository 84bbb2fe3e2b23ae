"""The reference MoE combine in plain torch: group tokens by expert, run, weight, combine.

The model's dense experts, the paged experts and the fused kernel's torch reference all
compute a layer through `moe_forward`, so there is one definition of what a MoE layer's
routed experts return, and every expert's activation goes through `gated`, so there is one
definition of each activation. `grouped_moe_forward` computes the same over stacked dense
weights with no host synchronisation and no per-expert Python loop (one sort, two grouped
matrix products): what the bf16 dense experts run on the GPU and inside a CUDA graph.
Shape legend: T tokens, H hidden, k top-k, E experts, I expert intermediate.
"""

from __future__ import annotations

import functools

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
    expert id; counts[e] is how many assignments expert e received. Counted by a
    scatter-add, not `bincount` (which reads the largest id back to the host on CUDA).
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def expert_bounds(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows in the expert-sorted
    assignments (group_tokens_by_expert's order), from its counts read to the host."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def expert_groups(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Yield (expert, token indices [n], routing weights [n]) for every expert with tokens."""
    k = topk_ids.shape[1]
    order, counts = group_tokens_by_expert(topk_ids, num_experts)
    token_of = order // k
    weights = topk_weights.reshape(-1)[order]
    for e, a, b in expert_bounds(counts.tolist()):
        yield e, token_of[a:b], weights[a:b]


def moe_forward(x, topk_ids, topk_weights, expert_fn, num_experts: int) -> torch.Tensor:
    """Reference MoE combine: run each expert on its tokens, weight, scatter-add.

    `expert_fn(e, tokens [n, H]) -> [n, H]` computes one expert; only experts that
    received tokens are called. Weights in x's dtype: products and sum in x's dtype; fp32
    weights with bf16 x (Gemma-4's router): products and sum in fp32, rounded once at the
    end, as transformers computes that family.
    """
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, topk_weights.dtype), device=x.device)
    for e, tokens, weights in expert_groups(topk_ids, topk_weights, num_experts):
        y = expert_fn(e, x[tokens]) * weights[:, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out.to(x.dtype)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Where `torch._grouped_mm` runs: the CPU (any float dtype), CUDA in bf16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16)


def grouped_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`moe_forward` over stacked weights gate_up [E, 2I, H] (gate rows first), down [E, H, I].

    The T*k assignments are sorted by expert; one grouped product per projection runs every
    expert on its rows (group e = rows offs[e-1]..offs[e], the counts' running sum, on the
    device); the rows go back to their (token, slot) places and are summed over k with their
    weights. Nothing is read back to the host, so the shapes a step runs depend only on T."""
    T, H = x.shape
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    # One sort, and the groups' ends by a binary search of every expert id in the sorted
    # ids (offs[e] = assignments to experts <= e): 3 launches, half of what argsort, a scatter-add
    # count and its running sum take, in a decode graph that replays them every layer.
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, _expert_ids(gate_up.shape[0], x.device), right=True, out_int32=True)
    rows = x[order // k]  # [T*k, H], sorted by expert
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(gated(gate, up, activation), down.transpose(1, 2), offs=offs)  # [T*k, H]
    placed = torch.empty_like(y)
    placed[order] = y  # back to (token, slot) order
    # fp32 weights (Gemma-4) keep the products and the sum over k in fp32, as in moe_forward
    weights = topk_weights.to(torch.promote_types(y.dtype, topk_weights.dtype))[..., None]
    return (placed.view(T, k, H) * weights).sum(dim=1).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _expert_ids(num_experts: int, device: torch.device) -> torch.Tensor:
    """0..E-1 on the device, made once (not inside a graph capture: the warm-up makes it)."""
    return torch.arange(num_experts, device=device)
