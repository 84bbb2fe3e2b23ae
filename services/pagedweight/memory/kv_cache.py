"""The paged KV cache: fixed-size blocks, one block table per sequence.

Two parts, as in nano-vllm's block manager:
- `KVBlockManager` keeps the bookkeeping only (free block ids, who owns which block) and
  speaks the shared vocabulary `can_allocate / allocate / free`.
- `PagedKVCache` owns the bytes. A block holds `block_size` tokens of every layer's keys
  and values, as `num_layers` TILES: tile (block, layer) is [2, block_size, G, D] (that
  layer's keys, then its values), contiguous, and tiles of one block need not be next to
  each other. The bytes live either
  - in a fixed tensor of `num_blocks` blocks (a block's tiles side by side, so a block
    is [L, 2, block_size, G, D] there), or
  - in the worker's memory arena (services/pagedweight/memory/arena.py), one extent per
    tile. Then the cache grows and shrinks while the server runs: `grow` takes tiles from
    the arena (bytes the weight pager freed by lowering bits: a dropped plane's hole
    holds whole tiles, so no weight has to move first), `shrink` gives free blocks back.
    Each tile is charged to the pool as `kv_free` while its block is empty and `kv_used`
    while it holds tokens.
Either way a device table maps (layer, block id) to the tile's row in `tiles` (a view of
the same memory), so attention gathers by block table on the device
(`read_blocks`, `kv_tile_offsets`), and `flat` is the same memory as one 1-D tensor that
never moves (writes, and kernels that take a base pointer plus offsets).

Token t of a sequence lives in block `block_ids[t // block_size]`, offset
`t % block_size`: its slot is block id * block_size + t % block_size.

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


# kv_tile_offsets_all answers None past this many table entries over all layers (two int64
# tensors of it: 256 MiB at 2^24)
_ALL_LAYERS_MAX_ENTRIES = 1 << 24


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


def kv_tile_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one tile: keys and values of block_size tokens in one layer (the unit the
    arena places; a block is num_layers tiles)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads, head_dim = model_config.kv_slot  # the widest layer's shape (Gemma-4's layers differ)
    return 2 * block_size * heads * head_dim * elem


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
        self._free: list[tuple[int, int]] = []  # heap of (sign * rank, block_id)
        self._owner: dict[int, int] = {}  # block_id -> seq_id
        self._rank: dict[int, int] = {}  # block_id -> where it sits (default: its id)

    def _key(self, block_id: int) -> tuple[int, int]:
        return self._sign * self._rank.get(block_id, block_id), block_id

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
        new = [heapq.heappop(self._free)[1] for _ in range(missing)]
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
            heapq.heappush(self._free, self._key(block_id))
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
            heapq.heappush(self._free, self._key(block_id))
            seq.block_ids[i] = RELEASED
            released.append(block_id)
        return released

    def add_blocks(self, block_ids, ranks=None) -> None:
        """Make blocks free; `ranks` (one per block) order them instead of their ids."""
        for i, block_id in enumerate(block_ids):
            if ranks is not None:
                self._rank[block_id] = ranks[i]
            heapq.heappush(self._free, self._key(block_id))

    def take_free_blocks(self, num_blocks: int) -> list[int]:
        """Remove up to num_blocks free blocks, least preferred first (to release them)."""
        ranked = sorted(self._free, reverse=True)  # least preferred first
        taken = [block_id for _, block_id in ranked[:num_blocks]]
        self._free = ranked[num_blocks:]
        heapq.heapify(self._free)
        for block_id in taken:
            self._rank.pop(block_id, None)
        return taken

    def owned_block_ids(self) -> dict[int, int]:
        return dict(self._owner)  # block_id -> seq_id


class PagedKVCache:
    """Block-table-addressed KV storage in per-layer tiles: a fixed tensor, or tiles grown
    from the arena."""

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
        self.tile_shape = (2, self.block_size, self.num_kv_heads, self.head_dim)  # one layer's K, V
        self.tile_elems = 2 * self.block_size * self.num_kv_heads * self.head_dim
        self.tile_bytes = kv_tile_bytes(model_config, config.block_size, dtype)
        self.block_bytes = kv_block_bytes(model_config, config.block_size, dtype)
        self.manager = KVBlockManager(config.block_size, prefer_high=arena is not None)
        self._tiles: dict[int, list] = {}  # block_id -> its L arena extents (layer order)
        elem = torch.empty((), dtype=dtype).element_size()
        L = self.num_layers
        if arena is None:
            # Tile row of (block b, layer l) = b * L + l: block b's bytes are contiguous,
            # [L, 2, block_size, G, D].
            self.flat = torch.zeros(num_blocks * L * self.tile_elems, dtype=dtype, device=self.device)
            self.tiles = self.flat.view(num_blocks * L, *self.tile_shape)
            self.row_stride = self.tile_elems  # elements from tile row r to r + 1
            rows = torch.arange(num_blocks * L, dtype=torch.int64).view(num_blocks, L).T
            self._tile_row = rows.contiguous().to(self.device)  # [L, blocks] -> tile row
            self.manager.add_blocks(range(num_blocks))
            self._free_ids: list[int] = []
        else:
            if arena.page_bytes % elem:
                raise ValueError(f"arena page size {arena.page_bytes} is not a multiple of {dtype}'s size")
            self.flat = arena.storage.view(dtype)
            self.tiles = arena.block_view(dtype, self.tile_shape)  # row p: the tile at page p
            self.row_stride = arena.page_bytes // elem
            # The most blocks the arena could ever hold: the table's fixed width, so it never
            # moves (a captured graph may hold it) and needs no host work to read.
            capacity = max(1, arena.num_pages // (L * arena.pages_for(self.tile_bytes)))
            self._tile_row = torch.zeros(L, capacity, dtype=torch.int64, device=self.device)
            self._free_ids = list(range(capacity - 1, -1, -1))  # logical block ids, popped from the end
            self._page_rows = self.flat.view(arena.num_pages, self.row_stride)  # one row per page
        # K and V halves of every tile row as their own views, so a gather by row yields
        # contiguous [n, block_size, G, D] keys and values
        num_rows, half = self.tiles.shape[0], self.tile_elems // 2
        shape, inner = (num_rows, *self.tile_shape[1:]), self.tiles.stride()[2:]
        self._k_rows = self.flat.as_strided(shape, (self.row_stride, *inner), 0)
        self._v_rows = self.flat.as_strided(shape, (self.row_stride, *inner), half)
        per_token = self.num_kv_heads * self.head_dim  # `flat` as token rows (write_rows)
        self._token_view = self.flat.narrow(0, 0, self.flat.numel() // per_token * per_token).view(-1, per_token)

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def charged_block_bytes(self) -> int:
        """What one block costs the pool: its L tiles, each rounded to whole pages."""
        if self.arena is None:
            return self.block_bytes
        return self.num_layers * self.arena.charged_bytes(self.tile_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks that hold tokens."""
        return self.manager.num_used_blocks * self.charged_block_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.num_blocks * self.charged_block_bytes

    def grow(self, num_blocks: int) -> int:
        """Take up to num_blocks more blocks from the arena; returns how many it got.

        A block is L tiles, each its own run of pages wherever the arena has one (highest
        first): the hole one dropped plane leaves holds whole tiles, so the bytes lowering
        frees are KV space without moving any weight."""
        if self.arena is None:
            return 0
        arena, need = self.arena, self.num_layers
        new, rows, ranks = [], [], []
        while len(new) < num_blocks and self._free_ids and arena.num_fitting(self.tile_bytes) >= need \
                and arena.pool.can_allocate(KV_FREE, self.charged_block_bytes):
            tiles = [arena.allocate(KV_FREE, self.tile_bytes) for _ in range(need)]
            block_id = self._free_ids.pop()
            self._tiles[block_id] = tiles
            new.append(block_id)
            rows.append([x.first_page for x in tiles])
            ranks.append(min(x.first_page for x in tiles))  # given back first: the lowest
        if new:
            self._place_new_blocks(new, rows)
        self.manager.add_blocks(new, ranks)
        return len(new)

    def _place_new_blocks(self, block_ids: list[int], first_pages: list[list[int]]) -> None:
        """Point the tile-row table at the new blocks' tiles and zero their pages, with no
        host synchronisation: ids and pages cross in one non-blocking copy from pinned
        memory, then two launches (a scatter and an index fill). A step in which 64
        sequences each crossing a block boundary would otherwise make 128 synchronising
        uploads and 1,536 small zeroing launches (profiled at concurrency 64, 4 bits).

        The pages held weights (or nothing) before: bytes that read as NaN in this dtype.
        Attention reads whole blocks and masks the positions past a sequence's end, but a
        masked NaN value still poisons softmax @ V (0 * NaN), so new tiles start at 0."""
        n, L = len(block_ids), self.num_layers
        host = torch.tensor([*block_ids, *(p for pages in first_pages for p in pages)], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        both = host.to(self.device, non_blocking=True)
        ids, pages = both[:n], both[n:].view(n, L)
        self._tile_row[:, ids] = pages.T
        per_tile = self.arena.pages_for(self.tile_bytes)  # an extent owns its whole pages
        every_page = (pages.reshape(-1, 1) + torch.arange(per_tile, device=self.device)).reshape(-1)
        self._page_rows.index_fill_(0, every_page, 0)

    def shrink(self, keep_free_blocks: int = 0) -> int:
        """Give free blocks back to the arena, keeping keep_free_blocks; returns bytes freed.
        The blocks whose tiles sit lowest (among the weights) go first."""
        if self.arena is None:
            return 0
        surplus = self.manager.num_free_blocks - keep_free_blocks
        freed = 0
        for block_id in self.manager.take_free_blocks(max(0, surplus)):
            for extent in self._tiles.pop(block_id):
                self.arena.free(extent)
                freed += extent.num_pages * self.arena.page_bytes
            self._free_ids.append(block_id)
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
            self._tiles[block_id] = self.arena.relabel_many(self._tiles[block_id], kind)

    # ---- addressing -----------------------------------------------------------------
    def token_offsets(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Slots of token positions start..end-1: block id * block_size + offset in the block.
        `write` and `read_tokens` turn a slot into each layer's place (tiles of one block
        need not be next to each other)."""
        bs = self.block_size
        return [block_ids[t // bs] * bs + t % bs for t in range(start, end)]

    def kv_tile_offsets(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Element offsets into `flat` of the K tile and the V tile of `layer` of every block
        in `block_table` (any shape; entries < 0 read as block 0). Each tile is contiguous,
        [block_size, G, D]. A gather from a device table: no host work."""
        rows = self._tile_row[layer][block_table.clamp(min=0)]
        k = rows * self.row_stride
        return k, k + self.tile_elems // 2

    def kv_tile_offsets_all(self, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`kv_tile_offsets` of every layer at once, [L, *block_table.shape] each: one gather
        per step instead of one per layer (decode graphs replay every launch: 4 per layer
        was 96 kernels a step at 24 layers). None when the result would be large (a wide
        table at a large batch): then each layer computes its own."""
        if self.num_layers * block_table.numel() > _ALL_LAYERS_MAX_ENTRIES:
            return None
        k = self._tile_row[:, block_table.clamp(min=0)] * self.row_stride
        return k, k + self.tile_elems // 2

    def token_rows(self, slots: torch.Tensor) -> torch.Tensor | None:
        """[T] slots -> [L, 2, T]: the rows of the cache seen as [*, G * D] token rows where
        each new token's K (0) and V (1) of every layer go, computed once per step; each
        layer's write is then one indexed copy per K and V instead of the ~10 kernels of
        building element indices. None when a tile row is not a whole number of token rows
        (an arena page size that is not a multiple of G * D elements): `write` then."""
        per_token = self.num_kv_heads * self.head_dim
        if self.row_stride % per_token:
            return None
        return torch.div(self.token_elements(slots), per_token, rounding_mode="floor")  # exact: rows start at multiples

    def token_elements(self, slots: torch.Tensor) -> torch.Tensor:
        """[T] slots -> [L, 2, T]: where in `flat` each new token's K (0) and V (1) row of
        every layer starts (G * D contiguous elements), for any tile layout (arena pages
        that are not whole token rows included): what the fused RoPE + KV write kernel
        (decode_ops.rope_write) writes through, computed once per step."""
        per_token = self.num_kv_heads * self.head_dim
        bs = self.block_size
        k = self._tile_row[:, torch.div(slots, bs, rounding_mode="floor")] * self.row_stride + (slots % bs) * per_token
        return torch.stack((k, k + bs * per_token), dim=1)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` through `token_rows(slots)` (rows [L, 2, T]): the same bytes to the same places."""
        T = k.shape[0]
        self._token_view.index_copy_(0, rows[layer, 0], k.reshape(T, -1).to(self.dtype))
        self._token_view.index_copy_(0, rows[layer, 1], v.reshape(T, -1).to(self.dtype))

    def _element_index(self, slots: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        """[T] slots -> [T, G * D] flat element indices of one layer's k or v."""
        per_token = self.num_kv_heads * self.head_dim
        bs = self.block_size
        rows = self._tile_row[layer][torch.div(slots, bs, rounding_mode="floor")]
        base = rows * self.row_stride + (kv * bs + slots % bs) * per_token
        return base[:, None] + torch.arange(per_token, device=slots.device)[None]

    # ---- reads and writes -----------------------------------------------------------
    def write(self, layer: int, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, G, D] of the new tokens at their slots (`token_offsets`)."""
        T = k.shape[0]
        self.flat[self._element_index(offsets, layer, 0)] = k.reshape(T, -1).to(self.dtype)
        self.flat[self._element_index(offsets, layer, 1)] = v.reshape(T, -1).to(self.dtype)

    def read_tokens(self, layer: int, offsets: torch.Tensor):
        """Gather single tokens by slot: (k, v) [T, G, D] (the reference path's read)."""
        shape = (offsets.shape[0], self.num_kv_heads, self.head_dim)
        k = self.flat[self._element_index(offsets, layer, 0)].view(shape)
        v = self.flat[self._element_index(offsets, layer, 1)].view(shape)
        return k, v

    def read_blocks(self, layer: int, block_ids: torch.Tensor):
        """Gather whole blocks by id: (k, v) [n, block_size, G, D]."""
        rows = self._tile_row[layer][block_ids]
        return self._k_rows[rows], self._v_rows[rows]
