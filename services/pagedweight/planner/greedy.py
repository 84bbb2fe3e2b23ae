"""Greedy bit moves: free X bytes with the least damage, spend Y bytes removing the most.

The algorithm, once:

Free X bytes. Every block i at q_i bits offers a chain of one-bit reductions
q_i -> q_i - 1 -> ... -> floor_i; step b -> b-1 frees bytes_i(b) - bytes_i(b-1) (planes
and LUT) and adds damage D_i(b-1) - D_i(b). The chains are not convex: the 4 -> 3 step
also drops LUT_4 for LUT_3, so it frees more bytes than the steps above it. So each chain
is first replaced by its lower convex hull in (bytes freed, damage): a run of steps that
lies above the hull becomes one *segment* that lowers several bits at once, keyed by the
hull's slope (damage per byte freed). Slopes rise along every chain, so one stable sort
of all segments by slope (ties by block index, then chain position) is the order a heap
of each block's next segment would pop, without a Python loop (~10^4 pops for a
Qwen1.5-MoE-size model would not fit in 5 ms). A cumulative sum with a binary search finds
where the freed bytes first reach X; every prefix of this order is the least damage for
the bytes it frees, even among fractional plans (the Lagrangian relaxation).

Completion. The prefix before that point frees F < X; the greedy's own next segment may
free far more than the X - F still missing. So every next segment c that alone completes
the target is tried, with an undo: the prefix's most recent segments (the dearest per
byte) are taken back, in reverse order and as far as c's over-shoot allows, skipping c's
own block. The candidate with the least damage wins.

Monotone in the budget. A larger budget (smaller X) never ends at more damage: across
prefixes because the result for X lies between the prefix damages on either side of it
(the relaxation's bound below, the greedy's own completion above); within one prefix
because a smaller X lets more segments complete and gives each a larger over-shoot, and
undoing a longer reverse run only removes damage (tests/planner/test_greedy.py checks
both the order against a literal heap and the monotonicity).

Spend Y bytes is the mirror image: one-bit increases keyed by damage removed per byte,
a running min along each chain, a stable sort in decreasing key, the longest prefix
that fits in Y; then a short fill loop adds the best next steps that still fit. Steps
that remove no damage are never taken (they would move pages for nothing).

Spending keeps one-bit steps with a running min: a segment's bits would all have to fit
at once, and the fill loop already takes what fits. Floors and ceilings are per block
(3..8, hot-expert floors, hysteresis locks); the caller sets them. Everything here is pure: arrays in, a new bit vector out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.format.blocks import MIN_BITS

_CHAIN = np.arange(5)[None, :]  # chain position k: the k-th one-bit step of a block
_MAX_FILL_ROUNDS = 64


@dataclass
class MoveResult:
    bits: np.ndarray  # int64 [N]: bit-width of every block after the moves
    num_bytes: int  # bytes freed (free_bytes) or spent (spend_bytes)
    damage_delta: float  # damage added (free_bytes) or removed (spend_bytes), >= 0
    shortfall: int = 0  # free_bytes: bytes still missing when every floor is reached
    moved_ids: np.ndarray | None = None  # block indices whose bits changed


def free_bytes(damage: np.ndarray, nbytes: np.ndarray, bits: np.ndarray,
               floors: np.ndarray, target: int) -> MoveResult:
    """Lower blocks by hull segments, least damage per byte first, until >= target bytes are freed."""
    bits = np.asarray(bits, dtype=np.int64)
    segs = _down_segments(damage, nbytes, bits, floors)
    if target <= 0:
        return _result(bits, bits.copy(), 0, 0.0)
    if segs.order.size == 0:
        return _result(bits, bits.copy(), 0, 0.0, int(target))
    cum = np.cumsum(segs.seg_bytes.flat[segs.order])
    if cum[-1] < target:  # every floor reached: take everything, report what is missing
        return _finish_free(segs, bits, segs.counts(segs.order), int(target - cum[-1]))
    last = int(np.searchsorted(cum, target, side="left"))
    freed_before = int(cum[last - 1]) if last else 0
    counts = _complete_and_undo(segs, segs.order[:last], target - freed_before)
    return _finish_free(segs, bits, counts, 0)


def spend_bytes(damage: np.ndarray, nbytes: np.ndarray, bits: np.ndarray,
                ceilings: np.ndarray, spare: int) -> MoveResult:
    """Raise blocks by one-bit steps, most damage removed per byte first, within `spare` bytes."""
    bits = np.asarray(bits, dtype=np.int64)
    steps = _up_steps(damage, nbytes, bits, ceilings)
    if spare <= 0 or steps.order.size == 0:
        return _result(bits, bits.copy(), 0, 0.0)
    cum = np.cumsum(steps.step_bytes.flat[steps.order])
    num_fit = int(np.searchsorted(cum, spare, side="right"))
    counts = steps.counts(steps.order[:num_fit])
    remaining = int(spare - (cum[num_fit - 1] if num_fit else 0))
    for _ in range(_MAX_FILL_ROUNDS):  # a few rounds at most: remaining < one step's bytes
        pick = _best_next_step(steps, counts, remaining, cheapest=False)
        if pick is None:
            break
        remaining -= int(steps.step_bytes[pick, counts[pick]])
        counts[pick] += 1
    new_bits = bits + counts
    return _result(bits, new_bits, int(spare - remaining), steps.chain_damage(counts))


@dataclass
class _Steps:
    """Every block's chain of one-bit raises, as [N, 5] arrays by chain position."""

    step_bytes: np.ndarray  # int64 [N, 5]: bytes added by the k-th step of block i
    step_damage: np.ndarray  # float64 [N, 5]: damage removed by that step
    valid: np.ndarray  # bool [N, 5]: a prefix of each row (steps within floor/ceiling)
    order: np.ndarray  # flat indices (i * 5 + k) of valid steps in greedy order

    def counts(self, flat_steps: np.ndarray) -> np.ndarray:
        """Steps taken per block (always a prefix of its chain)."""
        return np.bincount(flat_steps // 5, minlength=self.valid.shape[0]).astype(np.int64)

    def chain_damage(self, counts: np.ndarray) -> float:
        taken = _CHAIN < counts[:, None]
        return float(self.step_damage[taken].sum())


@dataclass
class _Segments:
    """Every block's chain of reductions as segments of its lower convex hull, each stored at
    the chain position (bits below q_i) where it starts; [N, 5] arrays, zero where none starts."""

    seg_bytes: np.ndarray  # int64 [N, 5]: bytes the segment starting at position k frees
    seg_damage: np.ndarray  # float64 [N, 5]: damage it adds
    seg_len: np.ndarray  # int64 [N, 5]: bits it lowers (0: no segment starts here)
    order: np.ndarray  # flat indices (i * 5 + k) of segment starts in greedy order

    def counts(self, flat_segs: np.ndarray) -> np.ndarray:
        """Bits lowered per block by these segments (always whole segments from the chain's top)."""
        return np.bincount(flat_segs // 5, weights=self.seg_len.flat[flat_segs],
                           minlength=self.seg_len.shape[0]).astype(np.int64)

    def next_segment(self, counts: np.ndarray):
        """Per block, the segment after `counts` bits: (available mask, bytes, damage, flat index)."""
        k = np.minimum(counts, 4)
        rows = np.arange(len(counts))
        available = (counts < 5) & (self.seg_len[rows, k] > 0)
        return available, self.seg_bytes[rows, k], self.seg_damage[rows, k], rows * 5 + k

    def chain_damage(self, counts: np.ndarray) -> float:
        return float(self.seg_damage[self._taken(counts)].sum())

    def chain_bytes(self, counts: np.ndarray) -> int:
        return int(self.seg_bytes[self._taken(counts)].sum())

    def _taken(self, counts: np.ndarray) -> np.ndarray:
        return (_CHAIN < counts[:, None]) & (self.seg_len > 0)


def _down_segments(damage, nbytes, bits, floors) -> _Segments:
    src = (bits - MIN_BITS)[:, None] - _CHAIN  # column of the bit-width before step k
    valid = src - 1 >= (np.asarray(floors) - MIN_BITS)[:, None]
    src = _flat(np.clip(src, 1, 5), damage.shape[1])
    step_damage = np.where(valid, np.maximum(_take(damage, src - 1) - _take(damage, src), 0.0), 0.0)
    step_bytes = np.where(valid, _take(nbytes, src) - _take(nbytes, src - 1), 0)
    slope = hull_slopes(step_bytes, step_damage, valid)
    starts = valid & np.concatenate([np.ones((len(bits), 1), bool), slope[:, 1:] != slope[:, :-1]], axis=1)
    seg_bytes, seg_damage = np.zeros_like(step_bytes), np.zeros_like(step_damage)
    seg_len = np.zeros_like(step_bytes)
    run_bytes, run_damage, run_len = np.zeros(len(bits), np.int64), np.zeros(len(bits)), np.zeros(len(bits), np.int64)
    for k in range(4, -1, -1):  # sum each run of steps back onto the position where it starts
        run_bytes += step_bytes[:, k]
        run_damage += step_damage[:, k]
        run_len += valid[:, k]
        seg_bytes[:, k] = np.where(starts[:, k], run_bytes, 0)
        seg_damage[:, k] = np.where(starts[:, k], run_damage, 0.0)
        seg_len[:, k] = np.where(starts[:, k], run_len, 0)
        run_bytes[starts[:, k]], run_damage[starts[:, k]], run_len[starts[:, k]] = 0, 0.0, 0
    flat = np.flatnonzero(starts)
    return _Segments(seg_bytes, seg_damage, seg_len, flat[_stable_order(slope.flat[flat])])


def hull_slopes(step_bytes: np.ndarray, step_damage: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """float64 [N, 5]: for each valid step, the slope of the lower convex hull of its chain's
    points (bytes freed, damage added) over that step; inf where not valid.

    The greatest convex minorant's slope over the interval (P_k, P_k+1) is
    max over i <= k of min over j > k of slope(P_i, P_j): 5 x 5 x 5 vector ops for any N.
    """
    n = len(step_bytes)
    freed = np.concatenate([np.zeros((n, 1)), np.cumsum(step_bytes, axis=1)], axis=1)
    added = np.concatenate([np.zeros((n, 1)), np.cumsum(step_damage, axis=1)], axis=1)
    point = np.concatenate([np.ones((n, 1), bool), valid], axis=1)  # points reached by valid steps
    slope = np.full((n, 5), np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        for k in range(5):
            best = np.full(n, -np.inf)
            for i in range(k + 1):
                low = np.full(n, np.inf)
                for j in range(k + 1, 6):
                    pair = (added[:, j] - added[:, i]) / (freed[:, j] - freed[:, i])
                    low = np.minimum(low, np.where(point[:, j], pair, np.inf))
                best = np.maximum(best, low)
            slope[:, k] = np.where(valid[:, k], best, np.inf)
    return slope


def _complete_and_undo(segs: _Segments, taken: np.ndarray, need: int) -> np.ndarray:
    """Bits lowered per block: the prefix `taken`, one completing segment that frees >= need
    alone, and what its over-shoot lets us undo (`_Undo`); of all completing segments, the
    one that ends at the least damage."""
    counts = segs.counts(taken)
    available, nbytes, damage, flat = segs.next_segment(counts)
    cand = np.flatnonzero(available & (nbytes >= need))  # never empty: the greedy's own next one
    undo = _Undo(segs, taken)
    gain, how = undo.gains(cand, nbytes[cand] - need)
    pos = int(np.argmin(damage[cand] - gain))
    block = int(cand[pos])
    counts[block] += segs.seg_len.flat[flat[block]]
    for seg in undo.undone(block, int(nbytes[block] - need), how[pos]):
        counts[seg // 5] -= segs.seg_len.flat[seg]
    return counts


class _Undo:
    """Segments of the prefix to take back within an over-shoot, never from the completing
    block: the better of (a) the latest segments (dearest per byte) in reverse order, as far
    as they fit, and (b) the single most damaging chain-end segment that fits. Both only
    grow with the room, which keeps the completion monotone in the target. Vectorised over
    the candidates; only a candidate whose own block is in the way is redone alone."""

    def __init__(self, segs: _Segments, taken: np.ndarray):
        self.segs, self.latest = segs, taken[::-1]
        self.latest_block = self.latest // 5
        self.cum_bytes = np.cumsum(segs.seg_bytes.flat[self.latest])
        self.cum_damage = np.concatenate([[0.0], np.cumsum(segs.seg_damage.flat[self.latest])])
        num_blocks = segs.seg_len.shape[0]
        self.first = np.full(num_blocks, len(self.latest), dtype=np.int64)
        np.minimum.at(self.first, self.latest_block, np.arange(len(self.latest)))
        # each lowered block's chain end is its latest segment: first in `latest`; by size,
        # with the running most damaging one
        ends = self.latest[self.first[self.first < len(self.latest)]]
        self.end_ids = ends[np.argsort(segs.seg_bytes.flat[ends], kind="stable")]
        self.end_bytes = segs.seg_bytes.flat[self.end_ids]
        end_damage = segs.seg_damage.flat[self.end_ids]
        self.end_damage = np.concatenate([[0.0], end_damage])
        best = np.where(end_damage == np.maximum.accumulate(end_damage), np.arange(len(end_damage)), 0)
        self.best_end = np.concatenate([[-1], np.maximum.accumulate(best)]) if len(ends) else np.array([-1])

    def gains(self, blocks: np.ndarray, rooms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate: damage removed, and how (0: the latest run, 1: one chain end)."""
        num = np.searchsorted(self.cum_bytes, rooms, side="right")
        run = self.cum_damage[num]
        end = self.best_end[np.searchsorted(self.end_bytes, rooms, side="right")]
        single = self.end_damage[end + 1]
        end_block = self.end_ids[np.maximum(end, 0)] // 5 if len(self.end_ids) else np.full(len(end), -1)
        alone = (self.first[blocks] <= num) | ((end >= 0) & (end_block == blocks))
        for pos in np.flatnonzero(alone):
            run[pos] = self._run(int(blocks[pos]), int(rooms[pos]))[0]
            single[pos] = self._single(int(blocks[pos]), int(rooms[pos]))[0]
        return np.maximum(run, single), (single > run).astype(np.int64)

    def undone(self, block: int, room: int, how: int) -> np.ndarray:
        return (self._single if how else self._run)(block, room)[1]

    def _run(self, block: int, room: int) -> tuple[float, np.ndarray]:
        latest = self.latest[self.latest_block != block]
        num = int(np.searchsorted(np.cumsum(self.segs.seg_bytes.flat[latest]), room, side="right"))
        return float(self.segs.seg_damage.flat[latest[:num]].sum()), latest[:num]

    def _single(self, block: int, room: int) -> tuple[float, np.ndarray]:
        fits = (self.end_bytes <= room) & (self.end_ids // 5 != block)
        if not fits.any():
            return 0.0, self.end_ids[:0]
        pick = int(np.argmax(np.where(fits, self.end_damage[1:], -np.inf)))
        return float(self.end_damage[pick + 1]), self.end_ids[pick:pick + 1]


def _up_steps(damage, nbytes, bits, ceilings) -> _Steps:
    src = (bits - MIN_BITS)[:, None] + _CHAIN
    valid = src + 1 <= (np.asarray(ceilings) - MIN_BITS)[:, None]
    src = _flat(np.clip(src, 0, 4), damage.shape[1])
    step_damage = np.maximum(_take(damage, src) - _take(damage, src + 1), 0.0)
    step_bytes = _take(nbytes, src + 1) - _take(nbytes, src)
    valid &= step_damage > 0
    valid = running(np.minimum, valid) > 0  # keep each row's valid steps a prefix
    ratio = np.where(valid, step_damage / step_bytes, -np.inf)
    key = running(np.minimum, ratio)
    flat = np.flatnonzero(valid)
    return _Steps(step_bytes, step_damage, valid, flat[_stable_order(key.flat[flat], descending=True)])


def _flat(columns: np.ndarray, width: int) -> np.ndarray:
    """[N, K] column indices of an [N, width] table -> flat indices (a 1-D take is ~3x faster
    than 2-D fancy indexing at 10^4 blocks)."""
    return columns + (np.arange(len(columns)) * width)[:, None]


def _take(table: np.ndarray, flat: np.ndarray) -> np.ndarray:
    return np.take(np.ascontiguousarray(table).ravel(), flat)


def running(op, table: np.ndarray) -> np.ndarray:
    """op.accumulate along axis 1 of a narrow [N, K] table (column by column: ~10x faster)."""
    out = np.array(table, dtype=np.result_type(table, np.float64))
    for k in range(1, out.shape[1]):
        op(out[:, k], out[:, k - 1], out=out[:, k])
    return out


def _stable_order(keys: np.ndarray, descending: bool = False) -> np.ndarray:
    """Positions of `keys` (finite, >= 0) sorted by key, ties by position: a stable argsort.

    Twice as fast as argsort(kind="stable"): a non-negative float64's bit pattern sorts
    like the float, so (key bits with the low mantissa bits replaced by the position)
    is one unique int64 per step and a plain value sort orders it. The dropped bits cost
    a relative precision of 2^-(52 - shift), below 1e-11 up to a million steps.
    """
    n = len(keys)
    shift = max(int(n).bit_length(), 1)
    keys = np.asarray(keys, dtype=np.float64) + 0.0  # -0.0 -> +0.0 (its sign bit would sort first)
    bits = keys.view(np.int64) >> shift
    if descending:
        bits = (np.iinfo(np.int64).max >> shift) - bits
    return np.sort((bits << shift) | np.arange(n, dtype=np.int64)) & ((1 << shift) - 1)


def _next_step(steps: _Steps, counts: np.ndarray):
    """Per block, the next untaken step: (available mask, bytes, damage)."""
    k = np.minimum(counts, 4)
    rows = np.arange(len(counts))
    available = (counts < 5) & steps.valid[rows, k]
    return available, steps.step_bytes[rows, k], steps.step_damage[rows, k]


def _best_next_step(steps: _Steps, counts: np.ndarray, max_bytes: int, cheapest: bool):
    available, step_bytes, step_damage = _next_step(steps, counts)
    available &= step_bytes <= max_bytes
    if not available.any():
        return None
    ratio = np.where(available, step_damage / step_bytes, np.nan)
    return int(np.nanargmin(ratio) if cheapest else np.nanargmax(ratio))


def _finish_free(segs: "_Segments", bits: np.ndarray, counts: np.ndarray, shortfall: int) -> MoveResult:
    return _result(bits, bits - counts, segs.chain_bytes(counts), segs.chain_damage(counts), shortfall)


def _result(old_bits, new_bits, num_bytes, damage_delta, shortfall=0) -> MoveResult:
    return MoveResult(new_bits, int(num_bytes), float(damage_delta), int(shortfall),
                      np.flatnonzero(new_bits != old_bits))
