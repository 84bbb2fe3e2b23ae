"""A contiguous KV cache: one preallocated [B, G, max_len, D] buffer per layer (G, D per layer).

Used by single-stream generation and evaluation. The serving engine uses the paged KV
cache instead (`services/pagedweight/memory`), which reads through block tables.
"""

from __future__ import annotations

import torch

from pagedweight.format.model_config import ModelConfig


class ContiguousKVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        # each layer its own shape: Gemma-4's sliding and full layers differ
        shapes = [(batch_size, config.attention(i).num_kv_heads, max_len, config.attention(i).head_dim)
                  for i in range(config.num_layers)]
        self.max_len = max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]

    def append(self, layer_idx: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, G, T, D] at start_pos; return the cache up to the new end."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > capacity {self.max_len}")
        self.keys[layer_idx][:, :, start_pos:end] = k
        self.values[layer_idx][:, :, start_pos:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]
