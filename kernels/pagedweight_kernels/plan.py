"""Launch planning, from host-known sizes only (no look at the routing): which regime a layer
call runs and each projection's grid and shared memory.

Regimes, by the average tokens per expert T*k/E (apl_moe's header):
  gemv     (<= 4 an expert) apl_gemv.cu's decode kernel, two launches;
  tiles    (<= 128 an expert, <= 4096 assignments) the same kernel with passes of 8 * NT8 tokens;
  staged   (on sm_90a, for the calls the tiles and prefill regimes would take, KernelConfig's
           rule) apl_staged.cu, four launches;
  prefill  apl_moe.cu's prefill kernel, four launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from pagedweight_kernels.config import DEFAULT_CONFIG, KernelConfig
from pagedweight_kernels.layer import GEMV_ROWS, MAX_BITS, APLKernelError, APLLayer, bit_class

# What this planning assumes of apl_gemv.cu's compile-time defaults (the host passes none of them, so
# the source's #ifndef defaults are what runs): decode CTAs an SM, 4 for the 3-4-bit kernel and 3 for
# those holding 5-8-bit blocks (KernelConfig's gemv_target_ctas and gemv_cell_target_ctas are a wave of
# them), and the L2::256B plane hint the long-split instances exist for (long_split) and the tiles
# instances from 64-token passes take. The rest is what the source always does: the tiles regime on
# wgmma with its raw rows of 528 bytes a token (gemv_extra_shared, compile.wgmma_build), one
# 128-thread CTA per work item in the planned grid order, programmatic launches compiled in
# (launch.programmatic_projections); APL_GEMV_L2_PREFETCH stays off (docs/kernel.md, "What we
# tried").
GEMV_SOURCE_DEFAULTS = {"APL_GEMV_MIN_BLOCKS": 4, "APL_GEMV_CELL_BLOCKS": 3, "APL_PLANE_HINT_MIN_NT8": 8}
FORCED_REGIMES = (None, "prefill")  # what apl_moe's `regime` argument may ask for
THREADS = 256  # the prefill kernel's and moe_combine's CTA
# The prefill kernel (apl_moe.cu): token tiles by tokens per expert, 64 weight rows a CTA.
PREFILL_TILES = ((12.0, 16), (40.0, 32), (80.0, 64))  # (up to this many tokens per expert, tile)
PREFILL_LARGEST_TILE = 128  # above the last limit
SMEM_ALIGN_PAD = 1024  # the prefill kernel rounds its shared memory start up to 1 KB (aligned_smem)
PREFILL_ROWS, PREFILL_SP = 64, 136  # weight rows per prefill CTA; padded shared row (u16)
# The decode kernel (apl_gemv.cu): two launches per layer.
GEMV_MAX_TOKENS_PER_EXPERT = 4.0  # above: the tiles regime; a hot expert takes passes of 8
GEMV_THREADS, GEMV_STEP_WORDS, GEMV_TOKENS = 128, 8, 8
GEMV_X_BYTES = 40 * 1024  # shared memory for one split's staged activations
GEMV_MIN_SPLIT_WORDS = 16  # a split covers at least two warp steps
# The decode kernels' 5-8-bit cell table (apl_gemv.cu's CELL_TAB_BYTES, CELL_TAB_ALIGN): one 2 KB
# column of 16 cells x 32 lanes per warp and row half, from a 2 KB boundary.
CELL_TABLE_BYTES, CELL_TABLE_ALIGN = 4 * 2 * 2048, 2048
# Decode column splits of 3-4-bit layers are chosen by whole waves (wave_splits): a grid of 1.21
# waves (Mixtral's down at 1 token, 5 splits: 640 CTAs) ends with one CTA per SM. The kernels
# holding 5-8-bit blocks, fewer CTAs per SM, gain nothing from the wave plan: their launches
# split to about gemv_cell_target_ctas CTAs.
GEMV_WAVE_PLAN_MAX_BITS = 4
GEMV_CTA_FIXED_STEPS = 2  # a CTA's prologue and epilogue (route, descriptor, LUT, reduction) in warp steps
GEMV_MAX_ASSIGN = 4096  # tokens * top_k a CTA's shared slot list holds
# Decode launches over long rows take the instance compiled for long splits (apl_gemv's LONG): its
# plane loads carry L2::256B, so a row's first load in each 256 bytes has L2 fetch the rest for the
# warp's next steps. Long: a split of at least GEMV_LONG_SPLIT_WORDS words (64 words are 256 bytes
# a row and plane, so the fetch never overshoots the split), rows of at least GEMV_LONG_ROW_WORDS,
# and at least GEMV_LONG_MIN_TOKENS tokens staged (at 1 token and on shorter rows the hint
# costs more than it saves).
# Chosen from the plan (shapes, tokens), never from the bits, so stable launches keep their instances.
GEMV_LONG_SPLIT_WORDS = 64
GEMV_LONG_ROW_WORDS = 128
GEMV_LONG_MIN_TOKENS = 2
# The tiles regime: the decode kernel's dequantisation, each weight's fragments reused for up to
# 8 * NT8 tokens per pass.
TILES_MAX_TOKENS_PER_EXPERT = 128.0  # above: the prefill (or staged) regime
TILES_MIN_NT8, TILES_MAX_NT8 = 2, 8  # the .cu's accumulators: 4 fp32 registers per 8-token tile
TILES_HEADROOM = 1.5  # a pass holds 1.5x the mean tokens per expert (routing is uneven)
# The staged regime (apl_staged.cu).
STAGED_ROWS, STAGED_STEP = 128, 64  # the .cu's ST_ROWS, ST_KS
STAGED_MAX_STAGES = 8  # the .cu's most ring buffers
STAGED_ALIGN_PAD = 1024  # the .cu's ST_ALIGN: the kernel aligns its shared memory up to a swizzled TMA tile's
STAGED_UNIT_STEPS = 2  # the .cu's U: steps a unit of a producer thread's plane words covers
# Units of plane words a producer thread has in flight (the .cu's P): 2 for 3-4-bit rows, 1 for
# 5-8-bit rows (8 planes a unit; with two producer warpgroups one kept the ring at 4 buffers).
STAGED_UNITS_LOW, STAGED_UNITS_HIGH = 2, 1


@dataclass(frozen=True)
class GemmPlan:
    """How one projection (gate_up or down) is launched."""

    regime: str  # "gemv" (tensor-core decode), "tiles" (the same kernel, 8-token tiles per pass),
    #              "staged" or "prefill" (dequantised tiles in shared memory)
    tokens: int  # gemv/tiles: tokens per pass; staged: tokens per pass; prefill: token tile (MT)
    rows_per_cta: int  # output rows per CTA (gate_up: h columns)
    splits: int  # column splits (gemv and tiles)
    split_cols: int
    grid: tuple[int, int, int]
    shared_bytes: int  # gemv: without the cell table and the tiles' raw rows (gemv_extra_shared, added per launch)
    tiles: int = 1  # gemv/tiles/staged: the kernel's NT8, 8-token tiles per pass (> 1: the tiles regime)
    stages: int = 0  # staged: the ring's buffers


@dataclass(frozen=True)
class LaunchPlan:
    gate_up: GemmPlan
    down: GemmPlan
    max_active: int  # upper bound on experts with tokens: min(E, T*k)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def plan_launch(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
                max_bits: int, stable_launches: bool = False, regime: str | None = None,
                config: KernelConfig = DEFAULT_CONFIG) -> LaunchPlan:
    """Pick the regime and the grids from host-known sizes only (no look at the routing).
    stable_launches: the layer's decode launches must not depend on its widths (a captured
    graph outlives bit moves; APLLayer.launch_signature), so no plan choice by max_bits.
    regime: None (by the sizes) or "prefill" (the prefill kernel at any size: a baseline, and
    how the tests reach it with few tokens)."""
    if regime not in FORCED_REGIMES:
        raise APLKernelError(f"regime must be one of {FORCED_REGIMES}, got {regime!r}")
    per_expert = num_tokens * top_k / num_experts
    max_active = min(num_experts, num_tokens * top_k)
    # (the tiles regime keeps each token's row offset in x / h as an int32)
    fits_gemv = regime is None and num_tokens * top_k <= GEMV_MAX_ASSIGN \
        and num_tokens * top_k * max(hidden, intermediate) < 2 ** 31
    if fits_gemv and per_expert <= TILES_MAX_TOKENS_PER_EXPERT:
        wide = config.tiles_wide_nt8 if bit_class(max_bits) == 0 and not stable_launches else 0
        nt8 = 1 if per_expert <= GEMV_MAX_TOKENS_PER_EXPERT else tiles_per_pass(per_expert, wide)
        waves = nt8 == 1 and max_bits <= GEMV_WAVE_PLAN_MAX_BITS and not stable_launches
        # (the decode kernels holding 5-8-bit blocks run 3 CTAs an SM, the 3-4-bit one 4)
        target = config.gemv_target_ctas if bit_class(max_bits) == 0 and not stable_launches else config.gemv_cell_target_ctas
        gate_up = _gemv_plan(0, num_tokens, top_k, hidden, intermediate, max_active, nt8, waves, target)
        down = _gemv_plan(1, num_tokens, top_k, intermediate, hidden, max_active, nt8, waves, target)
    else:
        mt = next((tile for limit, tile in PREFILL_TILES if per_expert <= limit), PREFILL_LARGEST_TILE)
        z = max(1, min(math.ceil(num_tokens / mt), math.ceil(per_expert / mt)))
        gate_up = _prefill_plan(0, mt, intermediate, max_active, z)
        down = _prefill_plan(1, mt, hidden, max_active, z)
    return LaunchPlan(gate_up, down, max_active)


def tiles_per_pass(per_expert: float, *wide: int) -> int:
    """The tiles regime's NT8: 8-token tiles per pass, room for TILES_HEADROOM x the mean
    tokens per expert, a power of two in [TILES_MIN_NT8, TILES_MAX_NT8], or the narrowest of the
    `wide` widths (a 3-4-bit layer's tiles_wide_nt8, the staged regime's staged_wide_nt8; 0: none)
    that holds them where more than TILES_MAX_NT8 are wanted. An expert with more tokens takes
    several passes (its weights dequantised once per pass)."""
    want = math.ceil(TILES_HEADROOM * per_expert / GEMV_TOKENS)
    if want > TILES_MAX_NT8:
        for width in sorted(w for w in wide if w):
            if want <= width:
                return width
    return min(TILES_MAX_NT8, max(TILES_MIN_NT8, _next_pow2(want)))


def _split_words(words: int, splits: int, max_split: int) -> int:
    """Words (of 32 columns) per column split: whole warp steps, at most max_split."""
    split_words = max(math.ceil(words / max(1, splits) / GEMV_STEP_WORDS) * GEMV_STEP_WORDS, GEMV_STEP_WORDS)
    return min(split_words, max_split)


def _wave_splits(ctas_per_split: int, words: int, most_splits: int, max_split: int, wave: int) -> int:
    """The decode launch's column splits, from a model of its time: whole waves of
    `wave` CTAs (4 CTAs per SM) times the longest CTA (its warp steps plus a fixed cost).
    Small layers split until one wave is full; a grid just over a whole number of
    waves takes fewer, longer splits instead of a tail wave (Mixtral's down at 1 token: 4
    splits, 512 CTAs, one wave, instead of 5 splits, 640 CTAs, 1.21 waves).
    Ties go to the smaller grid (fewer partials to reduce). Memoised: an eager layer call
    plans each projection (the search over splits costs ~17 us a Mixtral call on a CPU core)."""
    return _wave_splits_for(ctas_per_split, words, most_splits, max_split, wave, GEMV_CTA_FIXED_STEPS)


@lru_cache(maxsize=4096)
def _wave_splits_for(ctas_per_split: int, words: int, most_splits: int, max_split: int,
                     wave: int, fixed_steps: int) -> int:
    def cost(splits):
        split_words = _split_words(words, splits, max_split)
        grid = ctas_per_split * math.ceil(words / split_words)
        return math.ceil(grid / wave) * (math.ceil(split_words / GEMV_STEP_WORDS) + fixed_steps), grid
    return min(range(1, most_splits + 1), key=cost)


def _gemv_plan(mode, num_tokens, top_k, cols, rows_out, max_active, nt8: int, waves: bool,
               target_ctas: int) -> GemmPlan:
    # Split the columns until the launch has about target_ctas CTAs (small layers at 1
    # token would otherwise leave most SMs idle) and, at decode, a split's activations fit
    # their budget; the tiles regime stages one step at a time, so only the CTA count splits.
    rpc = GEMV_ROWS // 2 if mode == 0 else GEMV_ROWS
    tiles = math.ceil(rows_out / rpc)
    words = cols // 32
    stage = min(GEMV_TOKENS, num_tokens) if nt8 == 1 else GEMV_TOKENS * nt8
    max_split = GEMV_X_BYTES // ((stage + 1) * 64)
    max_split = max(GEMV_STEP_WORDS, max_split // GEMV_STEP_WORDS * GEMV_STEP_WORDS)
    if nt8 > 1:
        max_split = math.ceil(words / GEMV_STEP_WORDS) * GEMV_STEP_WORDS
    most_splits = max(1, words // GEMV_MIN_SPLIT_WORDS)
    if waves:
        splits = _wave_splits(tiles * max_active, words, most_splits, max_split, target_ctas)
    else:
        splits = min(math.ceil(target_ctas / (tiles * max_active)), most_splits)
    split_words = _split_words(words, splits, max_split)
    splits = math.ceil(words / split_words)
    num_assign = num_tokens * top_k
    staged_words = split_words if nt8 == 1 else GEMV_STEP_WORDS  # the .cu's tstride
    shared = (num_assign * 4 + 15) // 16 * 16 + (stage + 1) * (staged_words * 32 + 32) * 2
    return GemmPlan("gemv" if nt8 == 1 else "tiles", stage, rpc, splits, split_words * 32,
                    (tiles, max_active, splits), shared, nt8)


def _prefill_plan(mode, mt, rows_out, max_active, z) -> GemmPlan:
    rpc = PREFILL_ROWS // 2 if mode == 0 else PREFILL_ROWS
    shared = SMEM_ALIGN_PAD + 2 * (PREFILL_ROWS + mt) * PREFILL_SP  # the weight tile and the tokens' (no tables)
    grid = (math.ceil(rows_out / rpc), max_active, z)
    return GemmPlan("prefill", mt, rpc, 1, 0, grid, shared)


def staged_plan(mode: int, num_tokens: int, top_k: int, num_experts: int, rows_out: int, cls: int,
                lut_bits: int, max_active: int, aligned16: bool = True, config: KernelConfig = DEFAULT_CONFIG) -> GemmPlan:
    """One projection's launch in the staged regime (apl_staged.cu): passes of 8 * NT8 tokens as
    the tiles regime would choose them (tiles_per_pass; 96 tokens for 3-4-bit layers where it would
    take them and the planes are read as 16-byte vectors, aligned16: the 4-byte-load instances
    spill at 96; 128 tokens, staged_wide_nt8, where more than 96 are wanted there), grid (row
    tiles of 64 gate and 64 up rows or of 128 rows, active experts, groups of passes), and as many
    ring buffers, up to staged_stages, as leave 2 CTAs per SM room (else 1).
    lut_bits: the widest 5-8-bit block's bits (the producers' plane ring holds as many planes), 0 for none."""
    per_expert = num_tokens * top_k / num_experts
    wide = (config.tiles_wide_nt8, config.staged_wide_nt8) if cls == 0 else (config.staged_lut_wide_nt8,)
    nt8 = tiles_per_pass(per_expert, *(wide if aligned16 else ()))
    tokens = GEMV_TOKENS * nt8
    groups = max(1, min(math.ceil(num_tokens / tokens), math.ceil(per_expert / tokens)))
    rpc = STAGED_ROWS // 2 if mode == 0 else STAGED_ROWS
    planes = staged_plane_ring_bytes(cls, lut_bits) + staged_cell_tables(cls)
    stage = (STAGED_ROWS + tokens) * STAGED_STEP * 2  # the A tile, then the B tile
    least = staged_min_stages(cls)
    budgets = config.staged_cta_shared
    for budget in budgets[-1:] if staged_blocks(cls) == 1 else budgets:  # (one CTA an SM: its budget)
        stages = min(max(config.staged_stages, least), STAGED_MAX_STAGES,
                     (budget - STAGED_ALIGN_PAD - planes) // stage)
        if stages >= least:
            break
    else:
        raise APLKernelError(f"the staged regime needs {least} ring buffers of {stage} bytes beside {planes} bytes"
                             f" of plane words and cell tables")
    grid = (math.ceil(rows_out / rpc), max_active, groups)
    return GemmPlan("staged", tokens, rpc, 1, 0, grid, STAGED_ALIGN_PAD + stages * stage + planes, nt8, stages)


def staged_min_stages(cls: int) -> int:
    """The fewest ring buffers a staged launch of kernel class `cls` can run with. 2: the consumers
    hand a buffer back after the next one's wgmma are issued, so one would deadlock. With NP
    producer warpgroups taking every NP-th unit of steps in turn, a warpgroup's next step can be
    U (NP - 1) + 1 steps on from its last, and its parity wait for that step's buffer is sound only
    if the ring holds as many (apl_staged.cu's mbar_wait_phase)."""
    return max(2, STAGED_UNIT_STEPS * (staged_producers(cls) - 1) + 1)


def staged_cell_tables(cls: int) -> int:
    """Shared bytes of the staged producers' cell tables (the .cu's ST_CELL_BYTES a producer
    warpgroup: 16 cells of 4 bytes for each of its STAGED_ROWS rows) for the classes holding 5-8-bit
    rows, and the 1 KB more their 2 KB boundary may take beyond STAGED_ALIGN_PAD's."""
    return staged_producers(cls) * STAGED_ROWS * 16 * 4 + (CELL_TABLE_ALIGN - STAGED_ALIGN_PAD) if cls != 0 else 0


def staged_plane_ring_bytes(cls: int, lut_bits: int = 0) -> int:
    """The producers' plane ring past the ring buffers: per weight row, the largest of its widths'
    slots. 3-4-bit rows: STAGED_UNITS_LOW unit slots of 4 planes x 2 words a step; 5-8-bit rows
    (lut_bits planes, the launch's widest): STAGED_UNITS_HIGH. Per producer thread: staged_producers
    warpgroups of STAGED_ROWS threads."""
    words = 2 * STAGED_UNIT_STEPS  # a plane's words a unit
    low = STAGED_UNITS_LOW * 4 * words if cls != 1 else 0
    high = STAGED_UNITS_HIGH * lut_bits * words if cls != 0 else 0
    return staged_producers(cls) * STAGED_ROWS * max(low, high) * 4


def staged_blocks(cls: int) -> int:
    """CTAs an SM the staged instances of kernel class `cls` are compiled for (the .cu's
    staged_blocks): 2 for the 3-4-bit class, 1 for the others (more ring buffers a CTA)."""
    return 2 if cls == 0 else 1


def staged_producers(cls: int) -> int:
    """Producer warpgroups in a staged CTA of kernel class `cls` (the .cu's staged_producers): one for
    the 3-4-bit class (two CTAs an SM), two for the others (one CTA an SM: one left it latency-bound)."""
    return 1 if cls == 0 else 2


def staged_threads(cls: int) -> int:
    """A staged CTA's threads (the .cu's staged_threads): the consumer warpgroup and the producers'."""
    return 128 * (1 + staged_producers(cls))


def tiles_choices(cls: int, config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, ...]:
    """Every NT8 `plan_launch` can pick for launches of kernel class `cls`: 1 (decode), the tiles
    regime's powers of two, and for the 3-4-bit class tiles_wide_nt8 where it is set."""
    nt8, out = TILES_MIN_NT8, [1]
    while nt8 <= TILES_MAX_NT8:
        out.append(nt8)
        nt8 *= 2
    if cls == 0 and config.tiles_wide_nt8:
        out.append(config.tiles_wide_nt8)
    return tuple(out)


def staged_choices(cls: int, config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, ...]:
    """Every NT8 staged_plan can pick for kernel class `cls`: the tiles regime's, and the wider
    passes of staged_wide_nt8 (3-4 bits) or staged_lut_wide_nt8 (the others) where set."""
    choices = tiles_choices(cls, config)
    wide = config.staged_wide_nt8 if cls == 0 else config.staged_lut_wide_nt8
    if wide and wide not in choices:
        choices += (wide,)
    return choices


def staged_class(classes: dict[int, int]) -> tuple[int, int]:
    """(kernel class, lut_bits) of a staged launch over blocks of these bit classes (class ->
    widest bits): the merged class 2 where both are present; lut_bits the 5-8-bit class's widest."""
    cls = 2 if len(classes) > 1 else next(iter(classes))
    return cls, classes.get(1, 0)


def staged_launch(layer: APLLayer, module: str) -> tuple[int, int]:
    """(kernel class, lut_bits) of one projection's staged launch: by its blocks' classes
    (staged_class), or the merged class at MAX_BITS under stable_launches (its launches outlive
    the pager's bit moves)."""
    return (2, MAX_BITS) if layer.stable_launches else staged_class(layer.classes[module])


def staged_layer(layer: APLLayer, num_tokens: int, top_k: int, config: KernelConfig = DEFAULT_CONFIG) -> bool:
    """Whether the staged regime is the faster one for this layer's calls of num_tokens tokens:
    every block of both projections in staged_classes, and staged_min_assignments assignments or
    more for 3-4-bit layers, staged_lut_min_per_expert an expert for layers with 5-8-bit blocks
    (below them the tiles regime is faster); any layer under staged_every_layer. A layer under
    stable_launches counts as holding both classes (it launches the merged one whatever its widths)."""
    if config.staged_every_layer:
        return True
    classes = {0, 1} if layer.stable_launches else {c for module in ("gate_up", "down") for c in layer.classes[module]}
    least = config.staged_min_assignments if classes <= {0} else config.staged_lut_min_per_expert * layer.num_experts
    return classes <= config.staged_classes and num_tokens * top_k >= least


def use_staged(plan: LaunchPlan, layer: APLLayer, device: torch.device, num_tokens: int = 0, top_k: int = 0,
               regime: str | None = None, config: KernelConfig = DEFAULT_CONFIG) -> bool:
    """Whether a layer call planned so runs the staged regime instead: the tiles and prefill
    regimes' calls (not one that asked for the prefill kernel by `regime`) that staged_layer
    takes, on a compute-capability 9.0 device."""
    return (plan.gate_up.regime in ("tiles", "prefill") and regime is None
            and staged_layer(layer, num_tokens, top_k, config)
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def long_split(cls: int, plan: GemmPlan, cols: int) -> bool:
    """Whether a decode launch over rows of `cols` columns takes the long-split instance (any
    kernel class; the lengths above)."""
    return (plan.tiles == 1 and plan.tokens >= GEMV_LONG_MIN_TOKENS
            and plan.split_cols // 32 >= GEMV_LONG_SPLIT_WORDS and cols // 32 >= GEMV_LONG_ROW_WORDS)


def gemv_extra_shared(cls: int, tiles: int = 1) -> int:
    """Shared bytes an apl_gemv launch adds to its plan: the 5-8-bit cell table of the kernels that
    hold that class (apl_gemv.cu's CellTab: a 2 KB column per warp, lane and row half, from a 2 KB
    boundary), and in the tiles regime the raw activation rows of one step and each token's row
    offset (8 * tiles tokens x (528 + 4) bytes from a 512-byte boundary: the .cu's RAW_ROW on wgmma)."""
    table = CELL_TABLE_BYTES + CELL_TABLE_ALIGN if cls != 0 else 0
    if tiles > 1:
        raw_row = GEMV_STEP_WORDS * 64 + 16  # the .cu's RAW_ROW (264 u16) on wgmma
        return table + 512 + GEMV_TOKENS * tiles * (raw_row + 4)
    return table


def programmatic_down(cls: int, tiles: int) -> bool:
    """Whether a down launch of this kernel class and NT8 overlaps gate_up (programmatic dependent
    launch): the tiles regime and the 3-4-bit decode kernel (the 5-8-bit and merged decode
    kernels are slower so)."""
    return tiles > 1 or cls == 0
