"""The MoE decoder shared by every family (see format/model_config.py for the differences);
Gemma-4's layers are gemma4_layer.Gemma4DecoderLayer."""

from __future__ import annotations

import torch
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.contiguous_kv import ContiguousKVCache
from pagedweight.model.experts import DenseExperts
from pagedweight.model.gemma4_layer import Gemma4DecoderLayer, Gemma4MoeBlock
from pagedweight.model.layers import Attention, RMSNorm, RotaryEmbedding, norm_for, rope_key
from pagedweight.model.moe_block import SparseMoeBlock
from pagedweight_kernels import decode_ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = SparseMoeBlock(config, layer_idx)

    def forward(self, x, rope, start_pos, kv_cache):
        cos, sin = rope[self.self_attn.rope_key]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, kv_cache)
        return x + self.moe(self.post_attention_layernorm(x))

    def forward_from_layer(self, x: torch.Tensor, first_layer: int) -> torch.Tensor:
        """Logits [B, T, V] of running layers first_layer.. on their input x [B, T, H] (no cache,
        positions from 0): layer-local evaluation replays only the layers after a change."""
        B, T, _ = x.shape
        rope = self._rope(torch.arange(T, device=x.device).expand(B, T), x.dtype)
        for layer in self.layers[first_layer:]:
            x = layer(x, rope, 0, None)
        return self._logits(x)

    def forward_paged(self, x, rope, step):
        cos, sin = rope[self.self_attn.rope_key]
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, step)
        return x + self.moe(self.post_attention_layernorm(x))

    def forward_paged_fused(self, x: torch.Tensor, pending: tuple, rope, step):
        """`forward_paged` with decode_ops' kernels (MoECausalLM.fused_kernels): x [T, H] is
        the residual before the previous layer's MoE output `pending` (() for the first
        layer) is added; that add happens inside this layer's first norm, and this layer's
        own MoE output comes back unadded: -> (residual, pending)."""
        cos, sin = rope[self.self_attn.rope_key]
        x, h = add_rms_norm_pending(self.input_layernorm, x, pending)
        x, h = add_rms_norm_pending(self.post_attention_layernorm, x,
                                    (self.self_attn.forward_paged(h, cos, sin, step),))
        return x, self.moe.forward_parts(h)


def add_rms_norm_pending(norm: RMSNorm, x: torch.Tensor, pending: tuple):
    """(x + the pending sum, norm of it) in one kernel: pending is (), (delta,) or the MoE
    block's (routed, shared, gate logit) (SparseMoeBlock.forward_parts)."""
    return decode_ops.add_rms_norm(x, norm.weight, norm.eps, *pending)


def decoder_layer_class(config: ModelConfig) -> type[nn.Module]:
    return Gemma4DecoderLayer if config.is_gemma4 else DecoderLayer


def rotaries_for(config: ModelConfig) -> dict:
    """One RoPE per distinct (head_dim, theta, rotated pairs): Gemma-4's sliding and full
    layers have their own; cos/sin are computed once per forward for each."""
    keys = sorted({rope_key(config, i) for i in range(config.num_layers)})
    return {key: RotaryEmbedding(*key) for key in keys}


def rope_tables(rotaries: dict, positions: torch.Tensor, dtype: torch.dtype) -> dict:
    """rope_key -> (cos, sin) for `positions`: what every decoder layer's forward takes."""
    return {key: rotary.cos_sin(positions, dtype) for key, rotary in rotaries.items()}


def embed_scale_for(config: ModelConfig) -> float | None:
    """Gemma-4 scales embeddings by sqrt(H), rounded to the weights' dtype as transformers does."""
    return config.hidden_size ** 0.5 if config.is_gemma4 else None


def scale_embeddings(x: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
    return x if embed_scale is None else x * torch.tensor(embed_scale, dtype=x.dtype)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final logit softcapping (Gemma-4): cap * tanh(logits / cap); None leaves them."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class MoECausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # no N(0, 1) init: a model is built on the meta device and filled from its checkpoint
        # (model/materialize.py), and the meta device's normal_ imports torch._dynamo (~1.5 s of
        # CPU in every process that builds a model)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        layer_class = decoder_layer_class(config)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_layers))
        self.norm = norm_for(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotaries = rotaries_for(config)
        self.embed_scale = embed_scale_for(config)
        # paged steps through decode_ops' fused kernels (fuse_projections sets it on CUDA)
        self.fused_kernels = False

    def fuse_projections(self, kernels: bool = True, overlap_shared_experts: bool = False) -> None:
        """Each attention layer's q, k, v from one product (Attention.fuse_qkv): done by the
        engine on CUDA, once the weights are where they will be served from. With `kernels`
        on CUDA where decode_ops runs (not Gemma-4's layers), paged steps also take the fused
        kernels: residual add + norm, routing, RoPE + KV write, the shared expert's inputs
        from the router's product (SparseMoeBlock.fuse_inputs)."""
        for layer in self.layers:
            fuse = getattr(layer.self_attn, "fuse_qkv", None)
            if fuse is not None:
                fuse()
        self.fused_kernels = (kernels and self.device.type == "cuda" and not self.config.is_gemma4
                              and decode_ops.available())
        if self.fused_kernels:
            for layer in self.layers:
                layer.moe.fuse_inputs()
        for layer in self.layers:
            layer.self_attn.fused_kernels = self.fused_kernels
            if isinstance(layer.moe.experts, DenseExperts):
                layer.moe.experts.few_rows_kernel = self.fused_kernels
        self.overlap_shared_experts(overlap_shared_experts)

    def overlap_shared_experts(self, on: bool) -> bool:
        """Run each fused layer's shared expert on one side stream, concurrent with its
        routing and routed experts (SparseMoeBlock._forward_parts_overlapped); off: in
        sequence. Only with fused_kernels (CUDA) and a shared expert; True if any layer
        overlaps. CUDA graphs bake the choice in: switch before they are captured."""
        # Gemma-4's routed blocks (Gemma4MoeBlock) have no shared expert and no fused inputs
        blocks = [b for b in self.moe_blocks if isinstance(b, SparseMoeBlock) and b.shared_inputs_fused]
        stream = torch.cuda.Stream(self.device) if on and self.fused_kernels and blocks else None
        for block in blocks:
            block.shared_stream = stream
        return stream is not None

    @property
    def moe_blocks(self) -> list[SparseMoeBlock | Gemma4MoeBlock]:
        return [layer.moe for layer in self.layers]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scale_embeddings(self.embed_tokens(input_ids), self.embed_scale)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        return rope_tables(self.rotaries, positions, dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(self.norm(x)), self.config.final_logit_softcapping)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        start_pos: int = 0,
        kv_cache: ContiguousKVCache | None = None,
    ) -> torch.Tensor:  # logits [B, T, V]
        B, T = input_ids.shape
        positions = torch.arange(start_pos, start_pos + T, device=input_ids.device).expand(B, T)
        x = self._embed(input_ids)
        rope = self._rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, start_pos, kv_cache)
        return self._logits(x)

    def forward_paged(
        self,
        input_ids: torch.Tensor,  # [T]: the new tokens of every sequence in the step
        step,  # the attention context (paged_attention.PagedStep): positions, slots, tables
        logits_indices: torch.Tensor,  # [n]: the tokens whose next-token logits are wanted
    ) -> torch.Tensor:  # logits [n, V]
        """One continuous-batching step over the paged KV cache."""
        x = self._embed(input_ids)
        rope = self._rope(step.positions[None], x.dtype)  # each [1, 1, T, D]
        if self.fused_kernels:
            pending = ()
            for layer in self.layers:
                x, pending = layer.forward_paged_fused(x, pending, rope, step)
            _, h = add_rms_norm_pending(self.norm, x, pending)
            return soft_cap(self.lm_head(h[logits_indices]), self.config.final_logit_softcapping)
        for layer in self.layers:
            x = layer.forward_paged(x, rope, step)
        return self._logits(x[logits_indices])
