"""The MoE decoder shared by Mixtral and Qwen1.5-MoE (see config.py for the differences)."""

from __future__ import annotations

import torch
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.contiguous_kv import ContiguousKVCache
from pagedweight.model.layers import Attention, RMSNorm, RotaryEmbedding
from pagedweight.model.moe_block import SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = SparseMoeBlock(config, layer_idx)

    def forward(self, x, cos, sin, start_pos, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, kv_cache)
        return x + self.moe(self.post_attention_layernorm(x))

    def forward_paged(self, x, cos, sin, step):
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, step)
        return x + self.moe(self.post_attention_layernorm(x))


class MoECausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.moe for layer in self.layers]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        start_pos: int = 0,
        kv_cache: ContiguousKVCache | None = None,
    ) -> torch.Tensor:  # logits [B, T, V]
        B, T = input_ids.shape
        positions = torch.arange(start_pos, start_pos + T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, start_pos, kv_cache)
        return self.lm_head(self.norm(x))

    def forward_paged(
        self,
        input_ids: torch.Tensor,  # [T]: the new tokens of every sequence in the step
        step,  # the attention context (paged_attention.PagedStep): positions, slots, tables
        logits_indices: torch.Tensor,  # [n]: the tokens whose next-token logits are wanted
    ) -> torch.Tensor:  # logits [n, V]
        """One continuous-batching step over the paged KV cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(step.positions[None], x.dtype)  # [1, 1, T, D]
        for layer in self.layers:
            x = layer.forward_paged(x, cos, sin, step)
        return self.lm_head(self.norm(x[logits_indices]))
