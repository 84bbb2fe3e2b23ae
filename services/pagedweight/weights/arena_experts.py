"""The experts operator over the weight page table (the torch reference path).

Plugs into `SparseMoeBlock.experts` like `DenseExperts` (same call, same combine). For
each expert it dequantises its two blocks from the planes and LUT the page table says
are committed (`PageTable.resident_views`), so a step computes at exactly the committed
bits q_i. The fused CUDA kernel reads the same extents.

On CUDA with bf16/fp16 activations (and cupy present) the fused kernel
(kernels/pagedweight_kernels/apl_moe.cu) computes the whole layer in one go, reading the committed planes
and LUTs in place in the arena through per-block descriptors; elsewhere the torch
reference path below runs. Both paths key what they keep on the block's page-table
`version`, which every commit, lowering and relocation bumps, so neither ever reads a
stale extent: the kernel's descriptor rows are rewritten for exactly the blocks whose
version moved since the last step.

Dequantised weights may be cached on the reference path (on CPU it saves recomputing
them every step); the cache lives outside the budget, so it is off by default on CUDA.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight_kernels.apl_moe import ACT_DTYPES, APLLayer, ResidentBlock, apl_moe, kernel_available, precompile
from pagedweight_kernels.moe_reference import check_activation, gated, moe_forward
from pagedweight.format.apl_format import BlockId
from pagedweight.model.dequantized_experts import dequantize_block, weight_dtype
from pagedweight.weights.page_table import PageTable


class ArenaExperts(nn.Module):
    def __init__(self, table: PageTable, layer: int, num_experts: int, cache_dequantized: bool | None = None,
                 use_kernel: bool | None = None, activation: str = "silu", stable_launches: bool = False):
        super().__init__()
        check_activation(activation)
        self.activation = activation  # act(gate) * up, on both paths
        self.table = table
        self.layer = layer
        self.num_experts = num_experts
        # The fused kernel's decode launches do not depend on the layer's bits (APLLayer
        # .stable_launches): for a pager that moves bits, whose every change of a layer's bit
        # classes would otherwise make each decode graph capture again.
        self.stable_launches = stable_launches
        on_cuda = table.arena.device.type == "cuda"
        if cache_dequantized is None:
            cache_dequantized = not on_cuda
        self.cache_dequantized = cache_dequantized
        self._cache: dict[BlockId, tuple[int, torch.Tensor]] = {}  # block_id -> (version, weight)
        # None: the fused kernel wherever it can run.
        self.use_kernel = (on_cuda and kernel_available()) if use_kernel is None else use_kernel
        # gate_up blocks of experts 0..E-1, then down blocks: the order APLLayer takes them in
        self._block_ids = [BlockId(layer, e, m) for m in ("gate_up", "down") for e in range(num_experts)]
        self._kernel_layer: APLLayer | None = None
        self._kernel_versions: dict[BlockId, int] = {}  # block_id -> version its descriptor row shows
        self._kernel_generation = -1  # the table generation the descriptors show
        self._graph_state: tuple | None = None  # graph_state's answer at that generation

    def _resident(self, block_id: BlockId) -> ResidentBlock:
        planes, lut, bits = self.table.resident_views(block_id)
        return ResidentBlock(bits, [p.contiguous() for p in planes], lut.contiguous())

    def kernel_layer(self) -> APLLayer:
        """The kernel's view of this layer, its descriptors brought up to the committed state.
        While the table's generation has not moved no row has, so a step costs one compare
        here, not a walk over the layer's 2E blocks."""
        generation = self.table.generation
        if self._kernel_layer is not None and generation == self._kernel_generation:
            return self._kernel_layer
        if self._kernel_layer is None:
            E = self.num_experts
            blocks = [self._resident(b) for b in self._block_ids]
            self._kernel_layer = APLLayer(blocks[:E], blocks[E:], self.activation, self.stable_launches)
        else:
            start = time.perf_counter()
            moved = [(b.expert, b.module, self._resident(b)) for b in self._block_ids
                     if self.table.entries[b].version != self._kernel_versions[b]]
            self._kernel_layer.set_blocks(moved)
            self.table.num_descriptor_updates += len(moved)
            self.table.descriptor_seconds += time.perf_counter() - start
        self._kernel_versions = {b: self.table.entries[b].version for b in self._block_ids}
        self._kernel_generation = generation
        self._graph_state = None  # the bit classes may have changed
        return self._kernel_layer

    def weight(self, block_id: BlockId, dtype: torch.dtype) -> torch.Tensor:
        """The block's weight at its committed bits, [rows, cols] in `dtype`."""
        version = self.table.entries[block_id].version
        hit = self._cache.get(block_id)
        if hit is not None and hit[0] == version and hit[1].dtype == dtype:
            return hit[1]
        planes, lut, bits = self.table.resident_views(block_id)
        w = dequantize_block(torch.stack(planes), lut, bits, weight_dtype(dtype)).to(dtype)  # equal to apl_format.dequantize
        if self.cache_dequantized:
            self._cache[block_id] = (version, w)
        return w

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.weight(BlockId(self.layer, e, "gate_up"), x.dtype)
        down = self.weight(BlockId(self.layer, e, "down"), x.dtype)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(gated(gate, up, self.activation), down)

    def graph_state(self, dtype: torch.dtype):
        """For CUDA-graph replay of decode steps (engine/decode_graphs.py): brings the kernel's
        descriptor rows up to the committed state in place (device tensors a captured graph
        keeps reading) and returns the host-side launch choices a capture bakes in; None where
        activations of `dtype` take the reference path (its per-expert loop reads routing
        counts on the host)."""
        if not (self.use_kernel and self.table.arena.device.type == "cuda" and dtype in ACT_DTYPES):
            return None
        layer = self.kernel_layer()  # resets the cached state when the generation moved
        if self._graph_state is None:
            self._graph_state = layer.launch_signature()
        return self._graph_state

    def forward(self, x, topk_ids, topk_weights):
        if self.use_kernel and x.is_cuda and x.dtype in ACT_DTYPES:
            return apl_moe(x.contiguous(), topk_ids, topk_weights, self.kernel_layer())
        return moe_forward(x, topk_ids, topk_weights, self.expert, self.num_experts)


def install_arena_experts(model, table: PageTable, cache_dequantized: bool | None = None) -> None:
    """Replace every MoE block's experts operator with one reading the page table, and
    drop the dense expert tensors (they are not part of the paged model's memory)."""
    for layer, moe in enumerate(model.moe_blocks):
        moe.experts = ArenaExperts(table, layer, moe.experts.num_experts, cache_dequantized,
                                   activation=model.config.expert_activation)


def precompile_kernels(operators: list[ArenaExperts], dtype: torch.dtype) -> int:
    """Compile every fused-kernel instance these operators can launch with activations of
    `dtype` (every bit class, the merged one, both projections and plane layouts, every
    prefill tile), before the first step: the pager changes layers' bit classes while serving,
    and an instance first met then would compile inside a step or a decode-graph capture.
    Returns the instances compiled (0 where no operator uses the kernel)."""
    users = [op for op in operators if op.use_kernel and op.table.arena.device.type == "cuda"]
    if not users or dtype not in ACT_DTYPES:
        return 0
    device = users[0].table.arena.device
    return sum(precompile(dtype, activation, device) for activation in sorted({op.activation for op in users}))
