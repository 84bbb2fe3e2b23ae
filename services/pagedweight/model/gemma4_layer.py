"""Gemma-4's MoE decoder layer: a dense MLP beside the routed experts, four extra norms.

As transformers 5.24's `Gemma4TextDecoderLayer` with `enable_moe_block` computes it:

    h = x + post_attention_norm(attention(input_norm(x)))
    dense = post_ff_norm_1(mlp(pre_ff_norm(h)))                  # stays dense
    moe = post_ff_norm_2(experts(pre_ff_norm_2(h), router(h)))   # paged, like every family's
    out = (h + post_ff_norm(dense + moe)) * layer_scalar

The router sees the residual `h` (a scale-free RMSNorm, a learned scale and H^-1/2, then
softmax, top-k renormalised and a learned per-expert scale, its weights left in fp32); the
experts see `pre_ff_norm_2(h)`. Module names follow the checkpoint (`layers.N.router.proj`, ...) with
the MoE part under `moe` as in the other families, so loader.checkpoint_key maps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.experts import DenseExperts, ExpertsOp
from pagedweight.model.layers import Attention, GatedMLP, norm_for, rms_normalize
from pagedweight.model.moe_block import RoutingObserver


class Gemma4Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.eps = config.num_experts_per_tok, config.rms_norm_eps
        self.root_scale = config.hidden_size ** -0.5
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor):
        """x [T, H] -> topk_ids [T, k], topk_weights [T, k] in fp32 (softmax in fp32, as the reference).

        The weights stay fp32 for the experts' combine: transformers' Gemma-4 router never
        casts them back, so each expert's output is weighted and summed over k in fp32 and
        rounded once. Rounded to bf16 here (a step of up to 2^-9 of each weight) every MoE
        output moved by about a bf16 step, enough to flip near-tied top-k choices of the
        next layers' routers."""
        scores = self.proj(rms_normalize(x, self.eps) * self.scale * self.root_scale)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights * self.per_expert_scale[topk_ids]


class Gemma4MoeBlock(nn.Module):
    """The routed half of the feed-forward: router, experts and the experts' own two norms."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        H = config.hidden_size
        self.router = Gemma4Router(config)
        self.experts: ExpertsOp = DenseExperts(config.num_experts, H, config.expert_intermediate_size,
                                               config.expert_activation)
        self.pre_feedforward_layernorm_2 = norm_for(config, H)
        self.post_feedforward_layernorm_2 = norm_for(config, H)
        self.observer: RoutingObserver | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.router(h)
        x = self.pre_feedforward_layernorm_2(h)
        if self.observer is not None:
            self.observer(self.layer_idx, x, topk_ids, topk_weights)
        out = self.experts(x, topk_ids, topk_weights)
        return self.post_feedforward_layernorm_2(out).reshape(shape)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = norm_for(config, H)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = norm_for(config, H)
        self.pre_feedforward_layernorm = norm_for(config, H)
        self.mlp = GatedMLP(H, config.dense_intermediate_size, config.expert_activation)
        self.post_feedforward_layernorm_1 = norm_for(config, H)
        self.moe = Gemma4MoeBlock(config, layer_idx)
        self.post_feedforward_layernorm = norm_for(config, H)
        # a buffer in transformers, stored in the checkpoint: a parameter here, so it is loaded
        # and kept in the paged model's dense state like every other non-expert weight
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        return (h + self.post_feedforward_layernorm(dense + self.moe(h))) * self.layer_scalar

    def forward(self, x, rope, start_pos, kv_cache):
        cos, sin = rope[self.self_attn.rope_key]
        h = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, start_pos, kv_cache))
        return self._feed_forward(h)

    def forward_paged(self, x, rope, step):
        cos, sin = rope[self.self_attn.rope_key]
        h = x + self.post_attention_layernorm(self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, step))
        return self._feed_forward(h)
