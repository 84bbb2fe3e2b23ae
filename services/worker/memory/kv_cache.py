"""The paged KV cache: fixed-size blocks, one block table per sequence.

Two parts, as in nano-vllm's block manager:
- `KVBlockManager` keeps the bookkeeping only (free block ids, who owns which block) and
  speaks the shared vocabulary `can_allocate / allocate / free`.
- `PagedKVCache` owns the tensors. Its blocks come in *chunks* of `chunk_blocks` blocks,
  one tensor per chunk ([L, 2, C, block_size, G, D]), so the cache can grow and shrink while
  the server runs: growing takes a chunk's bytes from the memory pool (which the weight
  pager may have just freed by lowering bits), shrinking gives back trailing chunks whose
  blocks are all free. Free blocks are handed out lowest id first, so high chunks drain.

A slot is `block_id * block_size + offset`; token t of a sequence lives in slot
`block_ids[t // block_size] * block_size + t % block_size`.

Shape legend: L = layers, G = key/value heads, D = head dim, C = blocks per chunk.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.errors import UserError
from services.worker.model.config import ModelConfig

KV_KIND = "kv"  # the memory pool kind KV chunks are allocated under


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16  # tokens per block
    chunk_blocks: int = 16  # blocks taken from (and given back to) the pool at a time

    def __post_init__(self):
        if self.block_size < 1:
            raise UserError(f"KV block_size must be >= 1, got {self.block_size}")
        if self.chunk_blocks < 1:
            raise UserError(f"KV chunk_blocks must be >= 1, got {self.chunk_blocks}")


class BytePool(Protocol):
    """What the KV cache needs from the memory pool (services/worker/memory/pool.py)."""

    def can_allocate(self, kind: str, num_bytes: int) -> bool: ...
    def allocate(self, kind: str, num_bytes: int) -> None: ...
    def free(self, kind: str, num_bytes: int) -> None: ...


class BlockOwner(Protocol):
    """A sequence as the block manager sees it."""

    seq_id: int
    block_ids: list[int]  # the block table


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVBlockManager:
    """Free block ids and block tables; no tensors."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.num_blocks = 0
        self._free: list[int] = []  # heap: lowest id first
        self._owner: dict[int, int] = {}  # block_id -> seq_id

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

    def allocate(self, seq: BlockOwner, num_tokens: int) -> None:
        """Extend seq's block table to cover num_tokens tokens."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"KV: {missing} blocks wanted, {len(self._free)} free")
        for _ in range(missing):
            block_id = heapq.heappop(self._free)
            self._owner[block_id] = seq.seq_id
            seq.block_ids.append(block_id)

    def free(self, seq: BlockOwner) -> None:
        for block_id in seq.block_ids:
            if self._owner.pop(block_id, None) != seq.seq_id:
                raise RuntimeError(f"KV: block {block_id} is not owned by sequence {seq.seq_id}")
            heapq.heappush(self._free, block_id)
        seq.block_ids.clear()

    def add_blocks(self, block_ids: range) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)
        self.num_blocks += len(block_ids)

    def remove_free_blocks(self, block_ids: range) -> None:
        """Forget free blocks (their chunk is being released)."""
        gone = set(block_ids)
        if gone & self._owner.keys():
            raise RuntimeError("KV: cannot remove blocks that hold tokens")
        self._free = [b for b in self._free if b not in gone]
        heapq.heapify(self._free)
        self.num_blocks -= len(gone)

    def owned_block_ids(self) -> dict[int, int]:
        return dict(self._owner)  # block_id -> seq_id


class PagedKVCache:
    """KV tensors in chunks of blocks, grown from and shrunk back to the memory pool."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: KVCacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        pool: BytePool | None = None,
        max_blocks: int | None = None,
    ):
        self.config = config
        self.max_blocks = max_blocks  # a cap when there is no pool (fixed-size cache)
        self.block_size = config.block_size
        self.dtype, self.device, self.pool = dtype, torch.device(device), pool
        self.num_layers = model_config.num_layers
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.manager = KVBlockManager(config.block_size)
        self.chunks: list[torch.Tensor] = []  # each [L, 2, C, block_size, G, D]
        elem = torch.tensor([], dtype=dtype).element_size()
        self.block_bytes = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem
        self.chunk_bytes = self.block_bytes * config.chunk_blocks

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
        return len(self.chunks) * self.chunk_bytes

    def grow(self, num_blocks: int) -> int:
        """Add chunks until num_blocks more blocks exist or the pool says no; returns blocks added."""
        added = 0
        while added < num_blocks:
            if self.max_blocks is not None and self.num_blocks + self.config.chunk_blocks > self.max_blocks:
                break
            if self.pool is not None and not self.pool.can_allocate(KV_KIND, self.chunk_bytes):
                break
            if self.pool is not None:
                self.pool.allocate(KV_KIND, self.chunk_bytes)
            C = self.config.chunk_blocks
            shape = (self.num_layers, 2, C, self.block_size, self.num_kv_heads, self.head_dim)
            self.chunks.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            first = (len(self.chunks) - 1) * C
            self.manager.add_blocks(range(first, first + C))
            added += C
        return added

    def shrink(self, keep_free_blocks: int = 0) -> int:
        """Release trailing chunks whose blocks are all free, keeping at least
        keep_free_blocks free blocks; returns the bytes given back to the pool."""
        released = 0
        C = self.config.chunk_blocks
        owned = self.manager.owned_block_ids()
        while self.chunks:
            first = (len(self.chunks) - 1) * C
            last_chunk = range(first, first + C)
            if any(b in owned for b in last_chunk):
                break
            if self.manager.num_free_blocks - C < keep_free_blocks:
                break
            self.manager.remove_free_blocks(last_chunk)
            self.chunks.pop()
            if self.pool is not None:
                self.pool.free(KV_KIND, self.chunk_bytes)
            released += self.chunk_bytes
        return released

    # ---- reads and writes -----------------------------------------------------------
    def slot_mapping(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Slots of token positions start..end-1 of a sequence with this block table."""
        bs = self.block_size
        return [block_ids[t // bs] * bs + t % bs for t in range(start, end)]

    def write(self, layer: int, slots: "ChunkIndex", k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, G, D] of the new tokens at their slots."""
        for chunk_idx, rows, local in slots.groups:
            chunk = self.chunks[chunk_idx]
            blocks, offsets = local // self.block_size, local % self.block_size
            chunk[layer, 0, blocks, offsets] = k[rows]
            chunk[layer, 1, blocks, offsets] = v[rows]

    def read_slots(self, layer: int, slots: "ChunkIndex", num: int):
        """Gather single tokens: (k, v) [num, G, D] in the order indexed."""
        shape = (num, self.num_kv_heads, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for chunk_idx, rows, local in slots.groups:
            chunk = self.chunks[chunk_idx]
            blocks, offsets = local // self.block_size, local % self.block_size
            k[rows] = chunk[layer, 0, blocks, offsets]
            v[rows] = chunk[layer, 1, blocks, offsets]
        return k, v

    def read_blocks(self, layer: int, blocks: "ChunkIndex", num: int):
        """Gather whole blocks: (k, v) [num, block_size, G, D] in the order indexed."""
        shape = (num, self.block_size, self.num_kv_heads, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for chunk_idx, rows, local in blocks.groups:
            chunk = self.chunks[chunk_idx]
            k[rows] = chunk[layer, 0, local]
            v[rows] = chunk[layer, 1, local]
        return k, v

    def index(self, ids: list[int], per_chunk: int) -> "ChunkIndex":
        """Group global ids (slots or blocks) by chunk, once per step for all layers."""
        return ChunkIndex.build(ids, per_chunk, self.device)

    def slots_per_chunk(self) -> int:
        return self.config.chunk_blocks * self.block_size


@dataclass
class ChunkIndex:
    """Global ids grouped by the chunk they live in: (chunk, rows, local ids) per chunk.

    `rows` are positions in the caller's flat list, `local` the ids inside the chunk.
    Built on the host from the step's Python lists, sent to the device once per step.
    """

    groups: list[tuple[int, torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, ids: list[int], per_chunk: int, device) -> "ChunkIndex":
        by_chunk: dict[int, tuple[list[int], list[int]]] = {}
        for row, gid in enumerate(ids):
            rows, local = by_chunk.setdefault(gid // per_chunk, ([], []))
            rows.append(row)
            local.append(gid % per_chunk)
        groups = [
            (c, torch.tensor(rows, device=device), torch.tensor(local, device=device))
            for c, (rows, local) in sorted(by_chunk.items())
        ]
        return cls(groups)
