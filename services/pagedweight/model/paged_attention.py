"""Attention over the paged KV cache for a varlen batch (many sequences in one step).

A step flattens the new tokens of every scheduled sequence into one [T, ...] batch: a
sequence contributes `query_len` tokens at positions `context_len - query_len ..
context_len - 1` (a prefill chunk, or one decode token). Each layer first writes the new
keys/values at their slots, then attends through the block tables. Two paths:
- `reference`: per sequence, read its tokens slot by slot and call the same
  `causal_attention` the contiguous path uses. Plain and obviously right; the CPU default.
- `batched`: gather whole blocks for all sequences at once ([B, max_blocks * block_size]),
  pad the queries to [B, max_query_len] and run one masked SDPA. The CUDA default; on
  CUDA the key/value heads are expanded so SDPA can pick its memory-efficient kernel.
Tests compare the two, and the engine against single-stream generation.
A layer with a sliding window W passes it to `attend`: both paths then also mask keys
more than W - 1 positions behind the query (the cache still holds them).

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


class KVStore(Protocol):
    """What attention needs of the paged KV cache (memory.kv_cache.PagedKVCache is one);
    a protocol so model code never imports the memory layer."""

    device: torch.device
    block_size: int
    num_kv_heads: int
    head_dim: int

    def token_offsets(self, block_ids: list[int], start: int, end: int) -> list[int]: ...
    def write(self, layer: int, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read_tokens(self, layer: int, offsets: torch.Tensor): ...
    def read_blocks(self, layer: int, block_ids: torch.Tensor): ...
    def kv_tile_offsets(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

IMPLS = ("reference", "batched")


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
    # batched path
    block_table: torch.Tensor | None = None  # [B, max_blocks] block ids (pads: masked out)
    query_index: torch.Tensor | None = None  # [B, max_q] -> flat token (pad: 0)
    output_index: torch.Tensor | None = None  # [T] -> row in the flattened [B * max_q]
    mask: torch.Tensor | None = None  # [B, 1, max_q, S] bool
    query_pos: torch.Tensor | None = None  # [B, max_q] position of each padded query
    window_masks: dict | None = None  # window -> mask with the window applied, made on first use

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def attend(self, layer: int, q, k, v, window: int | None = None) -> torch.Tensor:
        return paged_attention(layer, q, k, v, self, window)

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
        impl = "batched" if kv.device.type == "cuda" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"paged attention impl {impl!r} is not one of {IMPLS}")
    seqs = [_read_released_as_live(s) for s in seqs]
    positions, new_offsets = [], []
    for s in seqs:
        start = s.context_len - s.query_len
        positions.extend(range(start, s.context_len))
        new_offsets.extend(kv.token_offsets(s.block_ids, start, s.context_len))
    host = [positions, new_offsets]
    if impl == "reference":
        host.append([o for s in seqs for o in kv.token_offsets(s.block_ids, 0, s.context_len)])
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
    else:
        step.block_table, step.query_index, query_pos, step.output_index = parts[2:]
        key_pos = torch.arange(step.block_table.shape[1] * kv.block_size, device=kv.device)
        step.mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # built on the device
        step.query_pos = query_pos  # sliding-window layers narrow the mask from it
    return step, extras


def _read_released_as_live(s: SeqSlice) -> SeqSlice:
    """Sliding-window models give back blocks whose tokens fell out of every window; their
    table entries are negative. Both paths read whole tables, so such an entry is pointed at
    one of the sequence's live blocks: finite values, at positions every layer masks out."""
    if min(s.block_ids, default=0) >= 0:
        return s
    live = next(b for b in s.block_ids if b >= 0)
    return SeqSlice([b if b >= 0 else live for b in s.block_ids], s.context_len, s.query_len)


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


def paged_attention(layer: int, q, k, v, step: PagedStep, window: int | None = None) -> torch.Tensor:
    """q [T, N, D], new k, v [T, G, D] -> attention output [T, N, D]."""
    step.kv.write(layer, step.new_offsets, k, v)
    if step.impl == "reference":
        return _reference(layer, q, step, window)
    return _batched(layer, q, step, window)


def _reference(layer: int, q, step: PagedStep, window: int | None = None) -> torch.Tensor:
    keys, values = step.kv.read_tokens(layer, step.context_offsets)
    outs, q_start, k_start = [], 0, 0
    for n, ctx in zip(step.query_lens, step.context_lens):
        qi = q[q_start : q_start + n].transpose(0, 1)[None]  # [1, N, n, D]
        ki = keys[k_start : k_start + ctx].transpose(0, 1)[None]  # [1, G, ctx, D]
        vi = values[k_start : k_start + ctx].transpose(0, 1)[None]
        outs.append(causal_attention(qi, ki, vi, ctx - n, window)[0].transpose(0, 1))
        q_start, k_start = q_start + n, k_start + ctx
    return torch.cat(outs, dim=0)


def _batched(layer: int, q, step: PagedStep, window: int | None = None) -> torch.Tensor:
    kv = step.kv
    B, max_blocks = step.block_table.shape
    k, v = kv.read_blocks(layer, step.block_table.reshape(-1))  # [B * max_blocks, bs, G, D]
    S = max_blocks * kv.block_size
    k = k.view(B, S, kv.num_kv_heads, kv.head_dim).transpose(1, 2)  # [B, G, S, D]
    v = v.view(B, S, kv.num_kv_heads, kv.head_dim).transpose(1, 2)
    qp = q[step.query_index].transpose(1, 2)  # [B, N, max_q, D]
    if q.device.type == "cuda":  # expanded heads let SDPA use its memory-efficient kernel
        groups = q.shape[1] // kv.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=step.batched_mask(window))
    else:
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=step.batched_mask(window), enable_gqa=True)
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [B * max_q, N, D]
    return out[step.output_index]
