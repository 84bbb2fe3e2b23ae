"""The experts operator over the weight page table (the torch reference path).

Plugs into `SparseMoeBlock.experts` like `DenseExperts` (same call, same combine). For
each expert it dequantises its two blocks from the planes and LUT the page table says
are committed (`PageTable.resident_views`), so a step computes at exactly the committed
bits q_i. The fused CUDA kernel (issue 6) reads the same extents.

Dequantised weights may be cached (on CPU it saves recomputing them every step); a
cache entry is keyed by the block's page-table `version`, which every commit, lowering
and relocation bumps, so a stale entry is never used. The cache lives outside the
budget, so it is off by default on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.experts import moe_forward
from services.worker.weights.apl_format import BlockId
from services.worker.weights.paged_experts import dequantize_block
from services.worker.weights.page_table import PageTable


class ArenaExperts(nn.Module):
    def __init__(self, table: PageTable, layer: int, num_experts: int, cache_dequantized: bool | None = None):
        super().__init__()
        self.table = table
        self.layer = layer
        self.num_experts = num_experts
        if cache_dequantized is None:
            cache_dequantized = table.arena.device.type != "cuda"
        self.cache_dequantized = cache_dequantized
        self._cache: dict[BlockId, tuple[int, torch.Tensor]] = {}  # block_id -> (version, weight)

    def weight(self, block_id: BlockId, dtype: torch.dtype) -> torch.Tensor:
        """The block's weight at its committed bits, [rows, cols] in `dtype`."""
        version = self.table.entries[block_id].version
        hit = self._cache.get(block_id)
        if hit is not None and hit[0] == version and hit[1].dtype == dtype:
            return hit[1]
        planes, lut, bits = self.table.resident_views(block_id)
        w = dequantize_block(torch.stack(planes), lut, bits).to(dtype)  # equal to apl_format.dequantize
        if self.cache_dequantized:
            self._cache[block_id] = (version, w)
        return w

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.weight(BlockId(self.layer, e, "gate_up"), x.dtype)
        down = self.weight(BlockId(self.layer, e, "down"), x.dtype)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    def forward(self, x, topk_ids, topk_weights):
        return moe_forward(x, topk_ids, topk_weights, self.expert, self.num_experts)


def install_arena_experts(model, table: PageTable, cache_dequantized: bool | None = None) -> None:
    """Replace every MoE block's experts operator with one reading the page table, and
    drop the dense expert tensors (they are not part of the paged model's memory)."""
    for layer, moe in enumerate(model.moe_blocks):
        moe.experts = ArenaExperts(table, layer, moe.experts.num_experts, cache_dequantized)
