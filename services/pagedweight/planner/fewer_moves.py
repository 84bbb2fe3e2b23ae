"""Free bytes by lowering fewer blocks further: each moved block carries a fixed cost.

The greedy (planner/greedy.py) frees bytes at the least damage per byte; since damage
grows ~4x per bit lost, that is almost always one bit off many blocks: a 1 GB shortage at
Qwen1.5-MoE's width lowers every one of its 1,440 blocks by a bit. Each lowered block is
a descriptor rewrite now and, once the pressure goes, a raise that copies its plane back.
Here every block that moves also costs `move_cost` (in damage units) on top of its
damage, and each block is offered whole drops q -> q - j, taken along the lower convex
hull of its (bytes freed, damage + move_cost) points (see free_with_fewer_moves). With
move_cost 0 this is the one-bit greedy's answer up to its overshoot handling; larger
values trade a little damage (deeper drops on fewer blocks) for fewer moves. O(N log N)
per plan, a short Python loop per block (plans are rare: one per ask, not per step).
"""

from __future__ import annotations

import numpy as np

from pagedweight.format.blocks import MIN_BITS


def move_cost_scale(damage: np.ndarray, bits: np.ndarray, floors: np.ndarray) -> float:
    """The median damage of one bit off a block that can go lower: move costs are given
    in these units, so one knob means the same at every model size and load."""
    rows = np.flatnonzero(bits > floors)
    if rows.size == 0:
        return 0.0
    col = bits[rows] - MIN_BITS
    return float(np.median(damage[rows, col - 1] - damage[rows, col]))


def free_with_fewer_moves(damage: np.ndarray, nbytes: np.ndarray, bits: np.ndarray, floors: np.ndarray,
                          target: int, move_cost: float) -> np.ndarray | None:
    """New bits freeing >= target bytes, each moved block charged move_cost; None when
    the floors cannot free the target (the caller keeps its own plan).

    A block's drops are points (bytes freed, damage + move_cost) beside (0, 0); its lower
    convex hull from (0, 0) is a chain of segments of rising cost per byte (the fixed cost
    makes the first segment jump straight to a deeper drop when that is cheaper per byte).
    All blocks' segments sorted by cost per byte are the greedy's order, as in
    planner/greedy.py; the completing segment stops at the shallowest drop that suffices."""
    bits = np.asarray(bits, dtype=np.int64)
    n, width = nbytes.shape
    rows = np.arange(n)[:, None]
    drops = np.arange(1, width)[None, :]  # a drop of j bits, j = 1..5
    valid = bits[:, None] - drops >= np.maximum(np.asarray(floors), MIN_BITS)[:, None]
    col_now = (bits - MIN_BITS)[:, None]
    col_new = np.clip(col_now - drops, 0, width - 1)
    freed = np.where(valid, nbytes[rows, col_now] - nbytes[rows, col_new], 0)
    cost = damage[rows, col_new] - damage[rows, col_now] + move_cost
    if int(freed.max(axis=1, initial=0).sum()) < target:  # even every block at its floor falls short
        return None
    segments = []  # (cost per byte, block, drop at its end, bytes)
    for i in np.flatnonzero(valid[:, 0]):
        hull = [(0, 0.0, 0)]
        for j in np.flatnonzero(valid[i]):
            point = (int(freed[i, j]), float(cost[i, j]), int(j) + 1)
            while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:
                hull.pop()
            hull.append(point)
        for a, b in zip(hull, hull[1:]):
            segments.append(((b[1] - a[1]) / max(b[0] - a[0], 1), int(i), b[2], b[0] - a[0]))
    segments.sort(key=lambda s: (s[0], s[1], s[2]))  # a block's segments rise: chain order kept
    drop = np.zeros(n, dtype=np.int64)
    got = 0
    for _, i, end, num_bytes in segments:
        if got + num_bytes >= target:  # the shallowest drop of this block that completes
            need = target - got + int(freed[i, drop[i] - 1]) if drop[i] else target - got
            drop[i] = 1 + int(np.argmax(valid[i] & (freed[i] >= need)))
            return bits - drop
        drop[i], got = end, got + num_bytes
    return None


def _turn(o, a, b) -> float:
    """> 0 when o -> a -> b turns left (b lies above the line o-a extended): a stays on the lower hull."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def raise_whole(damage: np.ndarray, nbytes: np.ndarray, bits: np.ndarray, ceilings: np.ndarray,
                byte_limit: int) -> np.ndarray | None:
    """New bits raising whole blocks, each straight to its ceiling, best damage saved per
    byte first, within `byte_limit`; None when not one whole raise fits (the caller keeps its
    own plan). The raising side of fewer moves: a spend greedy raises many blocks a bit at a
    time, plan after plan (on the H200, 543 blocks came back in 900 raise commits), and every
    commit is a descriptor rewrite and maybe a decode-graph capture; whole raises land each
    block once."""
    bits = np.asarray(bits, dtype=np.int64)
    top = np.maximum(np.asarray(ceilings, dtype=np.int64), bits)
    rows = np.arange(len(bits))
    cost = nbytes[rows, top - MIN_BITS] - nbytes[rows, bits - MIN_BITS]
    gain = damage[rows, bits - MIN_BITS] - damage[rows, top - MIN_BITS]
    candidates = np.flatnonzero((top > bits) & (gain > 0))
    order = candidates[np.lexsort((candidates, -gain[candidates] / np.maximum(cost[candidates], 1)))]
    taken = order[np.cumsum(cost[order]) <= byte_limit]
    if taken.size == 0:
        return None
    new = bits.copy()
    new[taken] = top[taken]
    return new
