"""The paged KV cache: fixed-size blocks, one block table per sequence.

Two parts, as in nano-vllm's block manager:
- `KVBlockManager` keeps the bookkeeping only (free block ids, who owns which block) and
  speaks the shared vocabulary `can_allocate / allocate / free`.
- `PagedKVCache` owns the bytes. A block holds `block_size` tokens of every layer's keys
  and values, laid out [L, 2, block_size, G, D]. The bytes live either
  - in a fixed tensor of `num_blocks` blocks (block id = index), or
  - in the worker's memory arena (services/pagedweight/memory/arena.py), one extent per block
    (block id = the extent's first page). Then the cache grows and shrinks while the
    server runs: `grow` takes blocks from the arena (bytes the weight pager freed by
    lowering bits), `shrink` gives free blocks back. Each block is charged to the pool
    as `kv_free` while empty and `kv_used` while it holds tokens.
Either way `blocks` is a view whose row `block_id` is that block, so attention gathers
by block table directly, and `flat` is the same memory as one 1-D tensor for writes
(the arena's block view has overlapping rows, which torch cannot write through).

Token t of a sequence lives in block `block_ids[t // block_size]`, offset
`t % block_size`.

Shape legend: L = layers, G = key/value heads, D = head dim.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedweight.common.errors import UserError
from pagedweight.format.model_config import ModelConfig

KV_USED, KV_FREE = "kv_used", "kv_free"  # the pool kinds (services/pagedweight/memory/pool.py)


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16  # tokens per block

    def __post_init__(self):
        if self.block_size < 1:
            raise UserError(f"KV block_size must be >= 1, got {self.block_size}")


class BlockOwner(Protocol):
    """A sequence as the block manager sees it."""

    seq_id: int
    block_ids: list[int]  # the block table


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: keys and values of block_size tokens in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads, head_dim = model_config.kv_slot  # the widest layer's shape (Gemma-4's layers differ)
    return 2 * model_config.num_layers * block_size * heads * head_dim * elem


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# A block-table entry whose block was given back because its tokens fell out of every
# layer's attention window: the entry stays so later positions keep their table index.
RELEASED = -1


class KVBlockManager:
    """Free block ids and block tables; no tensors.

    Free blocks are handed out in `prefer` order: lowest id first for a fixed cache,
    highest first in the arena (KV sits at the top, weights at the bottom, and the
    blocks given back first are the low ones next to the weights)."""

    def __init__(self, block_size: int, prefer_high: bool = False):
        self.block_size = block_size
        self._sign = -1 if prefer_high else 1
        self._free: list[int] = []  # heap of sign * block_id
        self._owner: dict[int, int] = {}  # block_id -> seq_id

    @property
    def num_blocks(self) -> int:
        return len(self._free) + len(self._owner)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._owner)

    def num_missing_blocks(self, seq: BlockOwner, num_tokens: int) -> int:
        """Blocks seq still needs so its table covers num_tokens tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def can_allocate(self, seq: BlockOwner, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: BlockOwner, num_tokens: int) -> list[int]:
        """Extend seq's block table to cover num_tokens tokens; returns the new block ids."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"KV: {missing} blocks wanted, {len(self._free)} free")
        new = [self._sign * heapq.heappop(self._free) for _ in range(missing)]
        for block_id in new:
            self._owner[block_id] = seq.seq_id
        seq.block_ids.extend(new)
        return new

    def free(self, seq: BlockOwner) -> list[int]:
        """Return seq's blocks to the free list; returns them."""
        live = [b for b in seq.block_ids if b != RELEASED]
        for block_id in live:
            if self._owner.get(block_id) != seq.seq_id:
                raise RuntimeError(f"KV: block {block_id} is not owned by sequence {seq.seq_id}")
        freed = live
        for block_id in freed:
            del self._owner[block_id]
            heapq.heappush(self._free, self._sign * block_id)
        seq.block_ids.clear()
        return freed

    def release_before(self, seq: BlockOwner, position: int) -> list[int]:
        """Give back seq's blocks holding only tokens before `position` (no query will read
        them again); their table entries become RELEASED. Returns the blocks given back."""
        released = []
        for i in range(min(position // self.block_size, len(seq.block_ids))):
            block_id = seq.block_ids[i]
            if block_id == RELEASED:
                continue
            if self._owner.get(block_id) != seq.seq_id:
                raise RuntimeError(f"KV: block {block_id} is not owned by sequence {seq.seq_id}")
            del self._owner[block_id]
            heapq.heappush(self._free, self._sign * block_id)
            seq.block_ids[i] = RELEASED
            released.append(block_id)
        return released

    def add_blocks(self, block_ids) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, self._sign * block_id)

    def take_free_blocks(self, num_blocks: int) -> list[int]:
        """Remove up to num_blocks free blocks, least preferred first (to release them)."""
        ranked = sorted(self._free, reverse=True)  # least preferred first
        taken = [self._sign * key for key in ranked[:num_blocks]]
        self._free = ranked[num_blocks:]
        heapq.heapify(self._free)
        return taken

    def owned_block_ids(self) -> dict[int, int]:
        return dict(self._owner)  # block_id -> seq_id


class PagedKVCache:
    """Block-table-addressed KV storage: a fixed tensor, or blocks grown from the arena."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: KVCacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int = 0,  # the fixed size when there is no arena
        arena=None,  # pagedweight.memory.arena.Arena: blocks come from it, on demand
    ):
        self.config = config
        self.block_size = config.block_size
        self.dtype, self.arena = dtype, arena
        self.device = torch.device(device) if arena is None else arena.device
        self.num_layers = model_config.num_layers
        # every layer gets its widest layer's slot; narrower layers use its front (paged_attention)
        self.num_kv_heads, self.head_dim = model_config.kv_slot
        self.block_shape = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        self.block_elems = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = kv_block_bytes(model_config, config.block_size, dtype)
        self.manager = KVBlockManager(config.block_size, prefer_high=arena is not None)
        self._extents: dict = {}  # block_id -> arena Extent
        if arena is None:
            self.flat = torch.zeros(num_blocks * self.block_elems, dtype=dtype, device=self.device)
            self.blocks = self.flat.view(num_blocks, *self.block_shape)
            self.block_stride = self.block_elems  # elements from block id i to i + 1
            self.manager.add_blocks(range(num_blocks))
        else:
            if arena.page_bytes % elem:
                raise ValueError(f"arena page size {arena.page_bytes} is not a multiple of {dtype}'s size")
            self.flat = arena.storage.view(dtype)
            self.blocks = arena.block_view(dtype, self.block_shape)
            self.block_stride = arena.page_bytes // elem

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks that hold tokens."""
        return self.manager.num_used_blocks * self.block_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def grow(self, num_blocks: int) -> int:
        """Take up to num_blocks more blocks from the arena; returns how many it got."""
        if self.arena is None:
            return 0
        new = []
        while len(new) < num_blocks and self.arena.can_allocate(KV_FREE, self.block_bytes):
            extent = self.arena.allocate(KV_FREE, self.block_bytes)
            self._extents[extent.first_page] = extent
            new.append(extent.first_page)
        self.manager.add_blocks(new)
        return len(new)

    def shrink(self, keep_free_blocks: int = 0) -> int:
        """Give free blocks back to the arena, keeping keep_free_blocks; returns bytes freed."""
        if self.arena is None:
            return 0
        surplus = self.manager.num_free_blocks - keep_free_blocks
        freed = 0
        for block_id in self.manager.take_free_blocks(max(0, surplus)):
            extent = self._extents.pop(block_id)
            self.arena.free(extent)
            freed += extent.num_pages * self.arena.page_bytes
        return freed

    # ---- block tables (the manager, plus the pool's kv_used / kv_free labels) --------
    def num_missing_blocks(self, seq: BlockOwner, num_tokens: int) -> int:
        return self.manager.num_missing_blocks(seq, num_tokens)

    def can_allocate(self, seq: BlockOwner, num_tokens: int) -> bool:
        return self.manager.can_allocate(seq, num_tokens)

    def allocate(self, seq: BlockOwner, num_tokens: int) -> None:
        for block_id in self.manager.allocate(seq, num_tokens):
            self._relabel(block_id, KV_USED)

    def free(self, seq: BlockOwner) -> None:
        for block_id in self.manager.free(seq):
            self._relabel(block_id, KV_FREE)

    def release_before(self, seq: BlockOwner, position: int) -> None:
        """Sliding-window models: free seq's blocks that fell out of every layer's window."""
        for block_id in self.manager.release_before(seq, position):
            self._relabel(block_id, KV_FREE)

    def _relabel(self, block_id: int, kind: str) -> None:
        if self.arena is not None:
            self._extents[block_id] = self.arena.relabel(self._extents[block_id], kind)

    # ---- reads and writes -----------------------------------------------------------
    def token_offsets(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Flat element offset (layer 0, keys) of token positions start..end-1."""
        bs, stride = self.block_size, self.block_stride
        per_token = self.num_kv_heads * self.head_dim
        return [block_ids[t // bs] * stride + (t % bs) * per_token for t in range(start, end)]

    def _element_index(self, offsets: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        """[T] token offsets -> [T, G * D] flat element indices of one layer's k or v."""
        per_token = self.num_kv_heads * self.head_dim
        base = offsets + (2 * layer + kv) * self.block_size * per_token
        return base[:, None] + torch.arange(per_token, device=offsets.device)[None]

    def write(self, layer: int, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, G, D] of the new tokens at their offsets."""
        T = k.shape[0]
        self.flat[self._element_index(offsets, layer, 0)] = k.reshape(T, -1).to(self.dtype)
        self.flat[self._element_index(offsets, layer, 1)] = v.reshape(T, -1).to(self.dtype)

    def read_tokens(self, layer: int, offsets: torch.Tensor):
        """Gather single tokens: (k, v) [T, G, D] (the reference path's read)."""
        shape = (offsets.shape[0], self.num_kv_heads, self.head_dim)
        k = self.flat[self._element_index(offsets, layer, 0)].view(shape)
        v = self.flat[self._element_index(offsets, layer, 1)].view(shape)
        return k, v

    def kv_tile_offsets(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Element offsets into `flat` of the K tile and the V tile of `layer` for every block
        id in `block_table` (any shape; entries < 0, released or padding, read block 0).

        Each tile is contiguous, [block_size, G, D]. Plain arithmetic on the table's device,
        no host work, so paged decode attention can compute it inside a CUDA graph and read
        the blocks where they are (the contract with the layout: a block is [L, 2, bs, G, D]
        at `block_id * block_stride`)."""
        tile = self.block_size * self.num_kv_heads * self.head_dim
        k = block_table.clamp_min(0) * self.block_stride + 2 * layer * tile
        return k, k + tile

    def read_blocks(self, layer: int, block_ids: torch.Tensor):
        """Gather whole blocks by id: (k, v) [n, block_size, G, D]."""
        return self.blocks[block_ids, layer, 0], self.blocks[block_ids, layer, 1]
