"""Attention over the paged KV cache for a varlen batch (many sequences in one step).

A step flattens the new tokens of every scheduled sequence into one [T, ...] batch: a
sequence contributes `query_len` tokens at positions `context_len - query_len ..
context_len - 1` (a prefill chunk, or one decode token). Each layer first writes the new
keys/values at their slots, then attends through the block tables. Two paths:
- `reference`: per sequence, read its tokens slot by slot and call the same
  `causal_attention` the contiguous path uses. Plain and obviously right; the CPU default.
- `batched`: gather whole blocks for all sequences at once ([B, max_blocks * block_size]),
  pad the queries to [B, max_query_len] and run one masked SDPA. On CUDA the key/value
  heads are expanded so SDPA can pick its memory-efficient kernel. Steps with a prefill
  chunk take this path on CUDA (tensor-core attention).
- `inplace`: decode steps (one new token per sequence) read each sequence's K/V tiles
  where they are in the cache, through `kv_tile_offsets`, with an online softmax
  (pagedweight_kernels.paged_decode: a Triton kernel on CUDA, the same arithmetic in torch
  elsewhere). No padded copy, no host values: it is what a CUDA graph of a decode step
  runs. A step holding a prefill chunk falls back to `batched`. The CUDA default.
Tests compare the paths, and the engine against single-stream generation.
A layer with a sliding window W passes it to `attend`: both paths then also mask keys
more than W - 1 positions behind the query (the cache still holds them).
Layers may differ in shape (Gemma-4's full-attention layers: fewer, wider KV heads): the
cache gives every layer a slot of its widest layer's G x D elements per token
(ModelConfig.kv_slot); a narrower layer writes its flattened k, v at the slot's front and
reads them back from there (`_into_slot`, `_from_slot`).

Shape legend: T = new tokens in the step, B = sequences, N = query heads,
G = key/value heads, D = head dim, S = padded context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from pagedweight.model.host_upload import upload_int64
from pagedweight.model.layers import causal_attention
from pagedweight_kernels import decode_ops
from pagedweight_kernels.paged_decode import (
    paged_decode_torch, paged_decode_triton, triton_available, triton_shape_supported,
)


class KVStore(Protocol):
    """What attention needs of the paged KV cache (memory.kv_cache.PagedKVCache is one);
    a protocol so model code never imports the memory layer."""

    device: torch.device
    block_size: int
    num_kv_heads: int
    head_dim: int
    flat: torch.Tensor  # the cache's storage as one 1-D tensor; it never moves while serving

    def token_offsets(self, block_ids: list[int], start: int, end: int) -> list[int]: ...
    def write(self, layer: int, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read_tokens(self, layer: int, offsets: torch.Tensor): ...
    def read_blocks(self, layer: int, block_ids: torch.Tensor): ...
    # where block b's K and V tiles of `layer` start in `flat` (entries < 0 read block 0)
    def kv_tile_offsets(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    # the same for every layer at once, [L, ...] (None: too large, ask per layer)
    def kv_tile_offsets_all(self, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    # where the new tokens' K, V of every layer go, [L, 2, T] (None: use `write`)
    def token_rows(self, slots: torch.Tensor) -> torch.Tensor | None: ...
    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    # where each new token's K and V row of every layer starts in `flat`, [L, 2, T]
    def token_elements(self, slots: torch.Tensor) -> torch.Tensor: ...

IMPLS = ("reference", "batched", "inplace")


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step."""

    block_ids: list[int]  # its block table, already covering context_len tokens
    context_len: int  # tokens in the cache after this step
    query_len: int  # new tokens computed in this step


@dataclass
class PagedStep:
    """Attention context of one forward step, built once and shared by every layer.

    The model passes it down to each attention layer, which calls `attend`: the layers
    know nothing of how the cache or the step were built (one-way imports).
    """

    kv: KVStore
    impl: str  # one of IMPLS
    positions: torch.Tensor  # [T] int64 position of each new token
    query_lens: list[int]  # per sequence
    context_lens: list[int]  # per sequence
    new_offsets: torch.Tensor  # [T] where each new token's k, v go (PagedKVCache.token_offsets)
    # reference path: every sequence's context tokens, concatenated
    context_offsets: torch.Tensor | None = None
    # batched and inplace paths
    block_table: torch.Tensor | None = None  # [B, max_blocks] block ids (pads: masked out)
    # inplace path: tokens in the cache per sequence (its query included), on the device
    seq_context_lens: torch.Tensor | None = None  # [B]
    query_index: torch.Tensor | None = None  # [B, max_q] -> flat token (pad: 0)
    output_index: torch.Tensor | None = None  # [T] -> row in the flattened [B * max_q]
    mask: torch.Tensor | None = None  # [B, 1, max_q, S] bool
    query_pos: torch.Tensor | None = None  # [B, max_q] position of each padded query
    window_masks: dict | None = None  # window -> mask with the window applied, made on first use
    # Per-step index work shared by every layer, made by the first layer that needs it
    # (inside a captured decode graph too: then it is part of the graph, once per replay)
    _write_rows: object = None  # KVStore.token_rows(new_offsets), or False where it gave None
    _tile_offsets: object = None  # KVStore.kv_tile_offsets_all(block_table), or False
    _elements: torch.Tensor | None = None  # KVStore.token_elements(new_offsets)

    def _rows(self):
        """KVStore.token_rows of the step's slots (made once), or False where it gave None."""
        if self._write_rows is None:
            self._write_rows = _or_false(self.kv.token_rows(self.new_offsets))
        return self._write_rows

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the layer's new k, v [T, slot G, slot D] at the step's slots."""
        rows = self._rows()
        if rows is False:
            self.kv.write(layer, self.new_offsets, k, v)
        else:
            self.kv.write_rows(layer, rows, k, v)

    def writes_rows_in_place(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether `rope_write` takes this step for a layer of kv_heads x head_dim in dtype:
        an in-place decode step, a layer as wide as the cache's slot, activations in the
        cache's own dtype, and the kernels present."""
        kv = self.kv
        return (self.impl == "inplace" and (kv_heads, head_dim) == (kv.num_kv_heads, kv.head_dim)
                and kv.flat.dtype == dtype and kv.flat.is_cuda and decode_ops.available())

    def rope_write(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   heads: int) -> torch.Tensor:
        """RoPE of q and k from the fused product qkv [T, (N + 2 G) D] and the layer's new
        k, v written to the cache, in one kernel (decode_ops.rope_write) -> q [T, N, D].
        Only where `writes_rows_in_place`; `attend_written` then attends."""
        kv = self.kv
        if self._elements is None:
            self._elements = kv.token_elements(self.new_offsets)
        starts = self._elements
        return decode_ops.rope_write(qkv, cos, signed_sin, heads, kv.num_kv_heads, kv.head_dim, kv.flat,
                                     starts[layer, 0], starts[layer, 1])

    def attend_written(self, layer: int, q: torch.Tensor, window: int | None = None,
                       scale: float | None = None) -> torch.Tensor:
        """`attend` for a layer whose new k, v are already in the cache (`rope_write`)."""
        return _inplace(layer, q, self, window, scale, (self.kv.num_kv_heads, self.kv.head_dim))

    def tile_offsets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V tile offsets of the block table (in-place path)."""
        if self._tile_offsets is None:
            self._tile_offsets = _or_false(self.kv.kv_tile_offsets_all(self.block_table))
        if self._tile_offsets is False:
            return self.kv.kv_tile_offsets(layer, self.block_table)
        k_all, v_all = self._tile_offsets
        return k_all[layer], v_all[layer]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def attend(self, layer: int, q, k, v, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        return paged_attention(layer, q, k, v, self, window, scale)

    def batched_mask(self, window: int | None) -> torch.Tensor:
        """The batched path's mask, narrowed to a sliding window (built once per step and window)."""
        if window is None:
            return self.mask
        if self.window_masks is None:
            self.window_masks = {}
        if window not in self.window_masks:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = key_pos[None, None, :] > (self.query_pos[:, :, None] - window)  # [B, max_q, S]
            self.window_masks[window] = self.mask & inside[:, None]
        return self.window_masks[window]


def build_step(kv: KVStore, seqs: list[SeqSlice], impl: str = "auto") -> PagedStep:
    """The step's attention context (see `build_step_with`)."""
    return build_step_with(kv, seqs, impl)[0]


def build_step_with(kv: KVStore, seqs: list[SeqSlice], impl: str = "auto",
                    extra: Sequence[list[int]] = ()) -> tuple[PagedStep, list[torch.Tensor]]:
    """The step's attention context; `extra` host index lists (the runner's input ids and
    logits rows) ride along in the same upload and come back on the device. Every index
    tensor crosses in one non-blocking copy (host_upload.py): building a step never waits
    for the GPU."""
    if impl == "auto":
        impl = "inplace" if kv.device.type == "cuda" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"paged attention impl {impl!r} is not one of {IMPLS}")
    if impl == "inplace" and any(s.query_len != 1 for s in seqs):
        impl = "batched"  # a prefill chunk: tensor-core attention over a gathered copy
    if impl != "inplace":  # the in-place path masks released entries itself
        seqs = [_read_released_as_live(s) for s in seqs]
    positions, new_offsets = [], []
    for s in seqs:
        start = s.context_len - s.query_len
        positions.extend(range(start, s.context_len))
        new_offsets.extend(kv.token_offsets(s.block_ids, start, s.context_len))
    host = [positions, new_offsets]
    if impl == "reference":
        host.append([o for s in seqs for o in kv.token_offsets(s.block_ids, 0, s.context_len)])
    elif impl == "inplace":
        host.extend(decode_metadata(kv.block_size, seqs))
    else:
        host.extend(_batched_metadata(kv.block_size, seqs))
    device_parts = upload_int64(host + list(extra), kv.device)
    parts, extras = device_parts[:len(host)], device_parts[len(host):]
    step = PagedStep(
        kv=kv, impl=impl, positions=parts[0],
        query_lens=[s.query_len for s in seqs],
        context_lens=[s.context_len for s in seqs],
        new_offsets=parts[1],
    )
    if impl == "reference":
        step.context_offsets = parts[2]
    elif impl == "inplace":
        step.block_table, step.seq_context_lens = parts[2:]
    else:
        step.block_table, step.query_index, query_pos, step.output_index = parts[2:]
        key_pos = torch.arange(step.block_table.shape[1] * kv.block_size, device=kv.device)
        step.mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # built on the device
        step.query_pos = query_pos  # sliding-window layers narrow the mask from it
    return step, extras


def _or_false(value):
    """None -> False: a per-step cache entry that was asked for and is not available."""
    return False if value is None else value


def _read_released_as_live(s: SeqSlice) -> SeqSlice:
    """Sliding-window models give back blocks whose tokens fell out of every window; their
    table entries are negative. Both paths read whole tables, so such an entry is pointed at
    one of the sequence's live blocks: finite values, at positions every layer masks out."""
    if min(s.block_ids, default=0) >= 0:
        return s
    live = next(b for b in s.block_ids if b >= 0)
    return SeqSlice([b if b >= 0 else live for b in s.block_ids], s.context_len, s.query_len)


def decode_metadata(bs: int, seqs: list[SeqSlice], width: int | None = None) -> list[torch.Tensor]:
    """Host tensors of the inplace path: block table [B, width] (RELEASED entries and
    padding stay negative: the kernel masks them) and context lengths [B]."""
    width = width or max(-(-s.context_len // bs) for s in seqs)
    table = torch.full((len(seqs), width), -1, dtype=torch.int64)
    for b, s in enumerate(seqs):
        used = s.block_ids[: -(-s.context_len // bs)]
        table[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
    return [table, torch.tensor([s.context_len for s in seqs], dtype=torch.int64)]


def _batched_metadata(bs: int, seqs: list[SeqSlice]) -> list[torch.Tensor]:
    """Host tensors of the batched path: block table [B, max_blocks], query index and query
    positions [B, max_q], output index [T]."""
    max_blocks = max(-(-s.context_len // bs) for s in seqs)
    max_q = max(s.query_len for s in seqs)
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    query_index = torch.zeros(len(seqs), max_q, dtype=torch.int64)
    query_pos = torch.zeros(len(seqs), max_q, dtype=torch.int64)  # pad rows see key 0 only
    output_index, start = [], 0
    for b, s in enumerate(seqs):
        used = s.block_ids[: -(-s.context_len // bs)]
        table[b] = torch.tensor(used + [used[0]] * (max_blocks - len(used)))  # pads are masked out
        n = s.query_len
        query_index[b, :n] = torch.arange(start, start + n)
        query_pos[b, :n] = torch.arange(s.context_len - n, s.context_len)
        output_index.extend(range(b * max_q, b * max_q + n))
        start += n
    return [table, query_index, query_pos, torch.tensor(output_index, dtype=torch.int64)]


def paged_attention(layer: int, q, k, v, step: PagedStep, window: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """q [T, N, D], new k, v [T, G, D] -> attention output [T, N, D] (scale: of q.k, None:
    1/sqrt(D)). G, D are the layer's own; the cache's slot may be wider (kv_slot)."""
    shape = (k.shape[1], k.shape[2])
    step.write_kv(layer, _into_slot(step.kv, k), _into_slot(step.kv, v))
    if step.impl == "reference":
        return _reference(layer, q, step, window, scale, shape)
    if step.impl == "inplace":
        return _inplace(layer, q, step, window, scale, shape)
    return _batched(layer, q, step, window, scale, shape)


def _inplace(layer: int, q, step: PagedStep, window: int | None, scale: float | None,
             shape: tuple[int, int]) -> torch.Tensor:
    """Decode: q [B, N, D], one token per sequence, reads the tiles where they are."""
    kv = step.kv
    k_off, v_off = step.tile_offsets(layer)
    if shape != (kv.num_kv_heads, kv.head_dim):
        # a layer narrower than the slot: its token rows are strided by the slot, which the
        # Triton kernel does not take; the torch path reads them in place, chunk by chunk
        # (memory bounded at any table width, device-side only, so graph-safe)
        return paged_decode_torch(q, kv.flat, k_off, v_off, step.seq_context_lens, kv.block_size, shape[0],
                                  window=window, block_table=step.block_table, scale=scale,
                                  row_elems=kv.num_kv_heads * kv.head_dim)
    args = (q, kv.flat, k_off, v_off, step.seq_context_lens, kv.block_size, kv.num_kv_heads)
    if q.is_cuda and triton_available() and triton_shape_supported(kv.head_dim, kv.block_size):
        return paged_decode_triton(*args, window=window, block_table=step.block_table, scale=scale)
    return paged_decode_torch(*args, window=window, block_table=step.block_table, scale=scale)


def _into_slot(kv: KVStore, t: torch.Tensor) -> torch.Tensor:
    """[T, G, D] of one layer -> [T, kv.num_kv_heads, kv.head_dim], zero-padded at the end."""
    if (t.shape[1], t.shape[2]) == (kv.num_kv_heads, kv.head_dim):
        return t
    flat = t.reshape(t.shape[0], -1)
    flat = F.pad(flat, (0, kv.num_kv_heads * kv.head_dim - flat.shape[1]))
    return flat.view(t.shape[0], kv.num_kv_heads, kv.head_dim)


def _from_slot(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[..., slot G, slot D] read from the cache -> [..., G, D] of the layer."""
    if (t.shape[-2], t.shape[-1]) == shape:
        return t
    return t.flatten(-2)[..., : shape[0] * shape[1]].unflatten(-1, shape)


def _reference(layer: int, q, step: PagedStep, window: int | None, scale: float | None,
               shape: tuple[int, int]) -> torch.Tensor:
    keys, values = (_from_slot(t, shape) for t in step.kv.read_tokens(layer, step.context_offsets))
    outs, q_start, k_start = [], 0, 0
    for n, ctx in zip(step.query_lens, step.context_lens):
        qi = q[q_start : q_start + n].transpose(0, 1)[None]  # [1, N, n, D]
        ki = keys[k_start : k_start + ctx].transpose(0, 1)[None]  # [1, G, ctx, D]
        vi = values[k_start : k_start + ctx].transpose(0, 1)[None]
        outs.append(causal_attention(qi, ki, vi, ctx - n, window, scale)[0].transpose(0, 1))
        q_start, k_start = q_start + n, k_start + ctx
    return torch.cat(outs, dim=0)


def _batched(layer: int, q, step: PagedStep, window: int | None, scale: float | None,
             shape: tuple[int, int]) -> torch.Tensor:
    kv = step.kv
    B, max_blocks = step.block_table.shape
    G, D = shape
    k, v = (_from_slot(t, shape) for t in kv.read_blocks(layer, step.block_table.reshape(-1)))  # [B * max_blocks, bs, G, D]
    S = max_blocks * kv.block_size
    k = k.reshape(B, S, G, D).transpose(1, 2)  # [B, G, S, D]
    v = v.reshape(B, S, G, D).transpose(1, 2)
    qp = q[step.query_index].transpose(1, 2)  # [B, N, max_q, D]
    if q.device.type == "cuda":  # expanded heads let SDPA use its memory-efficient kernel
        groups = q.shape[1] // G
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=step.batched_mask(window), scale=scale)
    else:
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=step.batched_mask(window), enable_gqa=True,
                                             scale=scale)
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [B * max_q, N, D]
    return out[step.output_index]
