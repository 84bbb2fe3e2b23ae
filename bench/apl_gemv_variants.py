"""Tuning runs for the tensor-core decode kernel (apl_gemv.cu) and its tiles regime, in one GPU call.

Times decode shapes (bench/apl_moe_kernel.py's method: layer copies, fresh routing per call,
CUDA-graph replays) under variants of its compile-time knobs (KERNEL_DEFINES) and host
plan constants, and prints one line per (variant, shape). Used to pick the defaults; the
results are recorded in docs/kernel.md.

Usage on the GPU machine: PYTHONPATH=.:services:kernels python3 -m bench.apl_gemv_variants [variants]
    [--mixed | --tiles | --tiles-mixed | --staged | --decode | --fused | --compact | --merged | --waves | --order | --lut | --hint
     | --long | --compile-only] [--json NAME]
--compile-only: compile the variants' decode instances for bf16 and fp16 (for the GPU tests) and exit.
--decode: every decode shape (1-16 tokens, 3 / 4 / 8 / mixed bits) at both model sizes; the
variants' instances are compiled first, in threads (NVRTC runs outside the GIL). --fused: the
3-4-bit decode shapes of the one-launch decode (`base unfused` compares it with two launches).
--compact: Qwen1.5-MoE 1-4 tokens and Mixtral 1-4 tokens, for the code-size and split variants.
--merged: the merged kernel's shapes (mixed bits; 4 bits under the `stable` variants).
--waves: the decode shapes whose column splits the whole-wave plan changed (`base no_wave`).
--order: mixed bits at 1-256 tokens and uniform 8 bits (the APL_GEMV_ORDER variants).
--hint: 3 / 4 / 8 / mixed bits at 1-256 tokens (the APL_PLANE_HINT and stable-launch variants).
--long: every decode width and mixed bits at 1 / 4 / 16 tokens (the long-split instance variants).
--json NAME
also writes bench/results/NAME.json (date, machine, commit).
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import pagedweight_kernels.apl_moe as op
from bench.bench_meta import write_result
from bench.apl_moe_kernel import COPIES, MODELS, REPS, SyntheticLayer, bit_assignment, routings, time_calls

SHAPES = [("mixtral-8x7b", 1, "3"), ("mixtral-8x7b", 1, "4"), ("mixtral-8x7b", 1, "8"), ("mixtral-8x7b", 1, "mixed"),
          ("mixtral-8x7b", 4, "4"), ("qwen1.5-moe-a2.7b", 1, "4"), ("qwen1.5-moe-a2.7b", 1, "mixed"),
          ("qwen1.5-moe-a2.7b", 16, "4")]
BASE = dict(op.KERNEL_DEFINES)
HOST_KNOBS = {name: getattr(op, name) for name in ("GEMV_TARGET_CTAS", "GEMV_MERGE_CLASSES", "TILES_MAX_NT8", "TILES_WIDE_NT8", "GEMV_FUSED",
                                                       "GEMV_MIN_SPLIT_WORDS", "GEMV_WAVE_PLAN", "GEMV_SHARED_PAD", "GEMV_PDL",
                                                       "GEMV_WAVE_PLAN_MAX_BITS", "GEMV_WIDE_TARGET_CTAS", "GEMV_LUT_AWARE_CTAS",
                                                       "GEMV_PDL_DOWN_CLASSES", "GEMV_LONG_SPLIT_CLASSES",
                                                       "GEMV_LONG_SPLIT_WORDS", "GEMV_LONG_ROW_WORDS",
                                                       "GEMV_LONG_MIN_TOKENS", "STAGED_PREFILL", "STAGED_STAGES", "STAGED_WIDE_NT8",
                                                       "STAGED_LUT_WIDE_NT8", "STAGED_CTA_SHARED",
                                                       "STAGED_CLASSES")}
# Host changes a variant may make to the layer rather than to a module attribute (main applies them):
# stable launches, and 8-byte plane loads off.
LAYER_SWITCHES = ("stable", "aligned8")
LUT_BEST = {"APL_STAGED_LUT_LANES": 1, "APL_STAGED_PREFETCH_LUT": 2, "APL_STAGED_TMA": 2}  # (H100, 2026-12-05)
VARIANTS = {  # name -> (define changes, host changes: HOST_KNOBS and LAYER_SWITCHES)
    "base": ({}, {}),
    # the staged regime (apl_staged.cu, 2026-12-03, fifth session): a producer warpgroup dequantises
    # plane tiles into a ring of shared buffers, a consumer warpgroup runs wgmma on both from there
    "staged": ({}, {"STAGED_PREFILL": True}),
    "staged_p1": ({"APL_STAGED_PREFETCH": 1}, {"STAGED_PREFILL": True}),  # one unit of plane words in flight
    "staged_p3": ({"APL_STAGED_PREFETCH": 3}, {"STAGED_PREFILL": True}),  # three
    "staged_u4": ({"APL_STAGED_UNIT": 4}, {"STAGED_PREFILL": True}),  # units of 4 steps: a plane's 32-byte sector at once
    # 3-4-bit plane words by cp.async into a shared ring per producer thread (not drained by each step's MEMBAR)
    "staged_async": ({"APL_STAGED_PLANE_ASYNC": 1}, {"STAGED_PREFILL": True}),
    "staged_async_u4": ({"APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_UNIT": 4}, {"STAGED_PREFILL": True}),
    # the producers' per-step proxy fence left to the consumers' (see apl_staged.cu)
    "staged_nofence": ({"APL_STAGED_PRODUCER_FENCE": 0}, {"STAGED_PREFILL": True}),
    # the plane ring with the other knobs (2026-12-05: staged_async was the fastest staged variant at 3-4 bits)
    "staged_async_nofence": ({"APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_PRODUCER_FENCE": 0}, {"STAGED_PREFILL": True}),
    "staged_async_p1": ({"APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_PREFETCH": 1}, {"STAGED_PREFILL": True}),
    "staged_async_p3": ({"APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_PREFETCH": 3}, {"STAGED_PREFILL": True}),
    "staged_wide16": ({}, {"STAGED_WIDE_NT8": 16}),  # passes of 128 tokens for 3-4-bit layers (the default rule)
    "staged_no128": ({}, {"STAGED_WIDE_NT8": 0}),  # no 128-token passes (before 2026-12-05's default)
    # every token row of a pass copied, zeros past the expert's count (before 2026-12-05's APL_STAGED_SKIP_PAD)
    "staged_zero_pad": ({"APL_STAGED_SKIP_PAD": 0, "APL_STAGED_TMA": 0}, {}),
    "staged_tma": ({"APL_STAGED_TMA": 1}, {}),  # activations by one TMA box a step (the default rule)
    "staged_cp_async": ({"APL_STAGED_TMA": 0}, {}),  # activations by the producers' 16-byte cp.async copies
    "staged_tma_nofence": ({"APL_STAGED_TMA": 1, "APL_STAGED_PRODUCER_FENCE": 0}, {}),  # and no producer fence
    # TMA activations and the staged regime for every prefill call (5-8 bits and few assignments too)
    "staged_tma_all": ({"APL_STAGED_TMA": 1}, {"STAGED_PREFILL": True}),
    # the 5-8-bit producers (2026-12-05, fourth session): lane-banked LUT rows (one wavefront a warp's
    # lookups), a second unit of plane words in registers, activations by TMA for every class
    "staged_lanes": ({"APL_STAGED_LUT_LANES": 1}, {"STAGED_PREFILL": True}),
    "staged_lanes_p2": ({"APL_STAGED_LUT_LANES": 1, "APL_STAGED_PREFETCH_LUT": 2}, {"STAGED_PREFILL": True}),
    "staged_lanes_tma2": ({"APL_STAGED_LUT_LANES": 1, "APL_STAGED_TMA": 2}, {"STAGED_PREFILL": True}),
    "staged_lanes_p2_tma2": (LUT_BEST, {"STAGED_PREFILL": True}),
    # and those at one CTA an SM (more ring buffers), with no producer fence, with passes of 128 tokens
    "staged_lut_one": ({**LUT_BEST, "APL_STAGED_LUT_BLOCKS": 1}, {"STAGED_PREFILL": True}),
    "staged_lut_one_copies": ({**LUT_BEST, "APL_STAGED_LUT_BLOCKS": 1, "APL_STAGED_TMA": 1}, {"STAGED_PREFILL": True}),
    "staged_lut_one_nofence": ({**LUT_BEST, "APL_STAGED_LUT_BLOCKS": 1, "APL_STAGED_PRODUCER_FENCE": 0},
                               {"STAGED_PREFILL": True}),
    "staged_lut_one_wide": ({**LUT_BEST, "APL_STAGED_LUT_BLOCKS": 1}, {"STAGED_PREFILL": True, "STAGED_LUT_WIDE_NT8": 16}),
    "staged_lut_one_wide_p4": ({**LUT_BEST, "APL_STAGED_LUT_BLOCKS": 1, "APL_STAGED_PREFETCH_LUT": 4},
                               {"STAGED_PREFILL": True, "STAGED_LUT_WIDE_NT8": 16}),
    # at the defaults since d2f4365, every prefill call staged: and the 5-8-bit plane words by cp.async
    "staged_all": ({}, {"STAGED_PREFILL": True}),
    "staged_pa_all": ({"APL_STAGED_PLANE_ASYNC_LUT": 1}, {"STAGED_PREFILL": True}),
    "staged_pa_p3_all": ({"APL_STAGED_PLANE_ASYNC_LUT": 1, "APL_STAGED_PREFETCH_LUT": 3}, {"STAGED_PREFILL": True}),
    "staged_pa_nofence_all": ({"APL_STAGED_PLANE_ASYNC_LUT": 1, "APL_STAGED_PRODUCER_FENCE": 0}, {"STAGED_PREFILL": True}),
    # a second producer warpgroup for the 5-8-bit and merged classes (384 threads; every other unit of steps),
    # with two or one unit of plane words in flight a thread
    "staged_wg2_all": ({"APL_STAGED_LUT_PRODUCERS": 2}, {"STAGED_PREFILL": True}),
    "staged_wg2_p1_all": ({"APL_STAGED_LUT_PRODUCERS": 2, "APL_STAGED_PREFETCH_LUT": 1}, {"STAGED_PREFILL": True}),
    "staged_wg2_nofence_all": ({"APL_STAGED_LUT_PRODUCERS": 2, "APL_STAGED_PRODUCER_FENCE": 0}, {"STAGED_PREFILL": True}),
    "tiles_only": ({}, {"STAGED_CLASSES": frozenset()}),  # the staged regime nowhere: the tiles and prefill regimes
    "staged_async_narrow": ({"APL_STAGED_PLANE_ASYNC": 1}, {"STAGED_PREFILL": True, "TILES_WIDE_NT8": 0}),  # no 96-token passes
    "staged_s2": ({}, {"STAGED_PREFILL": True, "STAGED_STAGES": 2}),  # a ring of two buffers
    "staged_noregs": ({"APL_STAGED_REGS": 0}, {"STAGED_PREFILL": True}),  # no setmaxnreg: 128 registers each
    "no_wave": ({}, {"GEMV_WAVE_PLAN": False}),  # decode splits to about one wave (before _wave_splits)
    # the last-CTA counter: one acq_rel atomic, no per-thread fences (the default since 2026-12-01)
    "acqrel": ({"APL_GEMV_ACQREL": 1}, {}),
    "no_acqrel": ({"APL_GEMV_ACQREL": 0}, {}),
    # fewer integer-pipe (ALU) instructions per weight (SASS counts in docs/kernel.md). Run at
    # 18a43a5 as APL_FMA_SHIFTS=1, which is APL_FMA_SHIFTS_MIN_BITS=3 here:
    "fma_shifts": ({"APL_FMA_SHIFTS_MIN_BITS": 3}, {}),  # code transposes as bitfield merges, shifts on the FMA pipe
    "fma_none": ({"APL_FMA_SHIFTS_MIN_BITS": 9}, {}),  # at no width (the code before 2026-12-01)
    "prmt_select": ({"APL_FMA_SHIFTS_MIN_BITS": 3, "APL_PRMT_SELECT": 1}, {}),  # + 4 bits: top-bit select by PRMT
    "alu_diet": ({"APL_FMA_SHIFTS_MIN_BITS": 3, "APL_PRMT_SELECT": 1, "APL_SHIFT_MODE": 1}, {}),  # + 5-8 bits: IMAD.HI offsets
    "alu_acqrel": ({"APL_FMA_SHIFTS_MIN_BITS": 3, "APL_PRMT_SELECT": 1, "APL_SHIFT_MODE": 1, "APL_GEMV_ACQREL": 1}, {}),
    "alu_pipe3_late": ({"APL_FMA_SHIFTS_MIN_BITS": 3, "APL_PRMT_SELECT": 1, "APL_SHIFT_MODE": 1, "APL_GEMV_PIPE": 3,
                        "APL_GEMV_PIPE_EARLY": 0}, {}),
    # decode activation staging: 4 16-byte loads per (token, word) and stage_word, not 32 2-byte loads
    "stage16": ({"APL_GEMV_STAGE16": 1}, {}),
    "stage2": ({"APL_GEMV_STAGE16": 0}, {}),
    # routing, the reductions and the tiles' copies one round trip at a time (before 2026-12-01, 22:00)
    "serial_loads": ({"APL_GEMV_BATCHED_LOADS": 0}, {}),
    # tiles on wgmma in clusters of 2 CTAs, each staging half a step into both (13-29% slower)
    "pair": ({"APL_TILES_PAIR": 1}, {}),
    # tiles on wgmma with a producer warp staging each step into two B buffers (apl_gemv_ws, 2026-12-03)
    "ws": ({"APL_TILES_WS": 1}, {}),
    "ws_rounds4": ({"APL_TILES_WS": 1, "APL_TILES_WS_ROUNDS": 4}, {}),  # 4 rounds of 8 tokens' loads in flight
    "ws2": ({"APL_TILES_WS": 1, "APL_TILES_WS_WARPS": 2}, {}),  # two producer warps (6 warps: no more registers)
    "ws2_s3": ({"APL_TILES_WS": 1, "APL_TILES_WS_WARPS": 2, "APL_TILES_WS_STAGES": 3}, {}),  # + a third B buffer
    "lut16": ({"APL_GEMV_LUT16": 1}, {}),  # aligned register-LUT rows by 16-byte loads (measured no faster)
    # more CTAs per SM at decode (registers capped: 5 -> 96, 6 -> 80; spills outside the step loop only)
    "blocks5": ({"APL_GEMV_MIN_BLOCKS": 5}, {"GEMV_TARGET_CTAS": 660}),
    "blocks6": ({"APL_GEMV_MIN_BLOCKS": 6}, {"GEMV_TARGET_CTAS": 792}),
    "blocks5_t528": ({"APL_GEMV_MIN_BLOCKS": 5}, {}),  # the same grids as base
    "unfused": ({}, {"GEMV_FUSED": False}),  # decode in two launches (gate_up, down), as before the fused kernel
    "fused": ({}, {"GEMV_FUSED": True}),  # 3-4-bit decode in one launch (apl_gemv_fused)
    # APL_GEMV_COMPACT, a bit per kernel class: one copy of the decode step's code (run at ea05a3c
    # as 1 = every class: "compact", "fused_compact", "compact_split8"; now 7)
    "compact": ({"APL_GEMV_COMPACT": 7}, {"GEMV_FUSED": False}),
    "no_compact": ({"APL_GEMV_COMPACT": 0}, {"GEMV_FUSED": False}),
    "fused_compact": ({"APL_GEMV_COMPACT": 7}, {"GEMV_FUSED": True}),
    "compact_split8": ({"APL_GEMV_COMPACT": 7}, {"GEMV_FUSED": False, "GEMV_MIN_SPLIT_WORDS": 8}),  # 1-step splits allowed
    "no_compact_stable": ({"APL_GEMV_COMPACT": 0}, {"stable": True}),  # stable launches: the merged kernel at any bits
    "stable": ({}, {"stable": True}),
    # decode launches given the merged kernel's 8-bit LUT room, unused (not yet run): is that room
    # what costs stable launches 7-21% at 3-4 bits? (`base shared_pad stable --merged`)
    "shared_pad": ({}, {"GEMV_SHARED_PAD": op.gemv_extra_shared(2, 1 << 8)}),  # (read while the pad is 0)
    # programmatic dependent launch (GEMV_PDL): the waits compiled in but launches serial
    # (the code's own cost), down overlapping gate_up's end, gate_up too overlapping the kernel
    # before it (in these graphs the previous call's down: an upper bound for a model, where
    # other kernels come between), down asking L2 for its split's planes before it waits (3-4 bits)
    "pdl_code": ({"APL_GEMV_PDL": 1}, {"GEMV_PDL": 0}),
    "no_pdl": ({"APL_GEMV_PDL": 0}, {"GEMV_PDL": 0}),  # serial launches, no waits compiled (before 2026-12-02)
    "pdl": ({"APL_GEMV_PDL": 1}, {"GEMV_PDL": 1}),
    "pdl_all": ({"APL_GEMV_PDL": 1}, {"GEMV_PDL": 2}),
    "pdl_planes": ({"APL_GEMV_PDL_PLANES": 1}, {}),  # decode down: the first step's planes in registers before the wait
    "pdl_prefetch": ({"APL_GEMV_PDL": 1, "APL_GEMV_PDL_PREFETCH": 1}, {"GEMV_PDL": 1}),
    "unfused_t352": ({}, {"GEMV_FUSED": False, "GEMV_TARGET_CTAS": 352}),  # fewer, longer CTAs
    "no_l2_prefetch": ({"APL_GEMV_L2_PREFETCH": 0}, {}),
    "target_1056": ({}, {"GEMV_TARGET_CTAS": 1056}),
    "4byte_loads": ({}, {"aligned8": False}),
    "merged_classes": ({}, {"GEMV_MERGE_CLASSES": True}),
    "per_class": ({}, {"GEMV_MERGE_CLASSES": False}),  # mixed layers: one launch per bit class
    "ring3": ({"APL_GEMV_RING_STAGES": 3}, {}),  # 3-4 bits: plane words through a cp.async ring
    "ring4": ({"APL_GEMV_RING_STAGES": 4}, {}),
    "ring6": ({"APL_GEMV_RING_STAGES": 6}, {}),
    # 3-4 bits (8-byte plane loads): S steps of plane words in registers, S - 1 in flight
    "pipe3": ({"APL_GEMV_PIPE": 3, "APL_GEMV_PIPE_EARLY": 1}, {}),  # 128 registers; first steps before the LUT
    "pipe3_late": ({"APL_GEMV_PIPE": 3, "APL_GEMV_PIPE_EARLY": 0}, {}),  # first steps loaded after staging
    "pipe4_3_blocks": ({"APL_GEMV_PIPE": 4, "APL_GEMV_PIPE_EARLY": 1, "APL_GEMV_MIN_BLOCKS": 3},
                       {"GEMV_TARGET_CTAS": 396}),  # 168 registers, 3 CTAs per SM
    "tiles_3_blocks": ({"APL_TILES_MIN_BLOCKS": 3}, {}),  # tiles regime: <= 168 registers, 3 CTAs per SM
    "tiles_2_blocks": ({"APL_TILES_MIN_BLOCKS": 2}, {}),  # tiles regime: 2 CTAs per SM at every class (before 2026-12-02)
    "tiles_max_32": ({}, {"TILES_MAX_NT8": 4}),  # tiles regime: at most 32 tokens per pass
    "wide12": ({}, {"TILES_WIDE_NT8": 12}),  # 3-4-bit layers: 96-token passes where 64 would not hold 1.5x the mean
    "wide_off": ({}, {"TILES_WIDE_NT8": 0}),  # (the default since 2026-12-03: 12)
    # tiles regime on wgmma (sm_90a): a pass's tokens as the N of one warpgroup instruction per k16 slice
    "wgmma": ({"APL_TILES_WGMMA": 1}, {}),  # (the default since 2026-12-01)
    "mma_sync": ({"APL_TILES_WGMMA": 0}, {}),  # the tiles regime's mma.sync path, as other GPUs run it
    "wgmma_3_blocks": ({"APL_TILES_WGMMA": 1, "APL_TILES_MIN_BLOCKS": 3}, {}),  # 168 registers, 3 CTAs per SM
    # the 5-8-bit and merged kernels' CTA order (APL_GEMV_ORDER): widest experts first, expert-major
    # CTA numbering, the tiles regime too (`base order_0 order_heavy order_major order_3 order_7 --order`)
    "order_0": ({"APL_GEMV_ORDER": 0}, {}),
    "order_1": ({"APL_GEMV_ORDER": 1}, {}),  # widest first, at decode
    "order_2": ({"APL_GEMV_ORDER": 2}, {}),  # expert-major, at decode
    "order_3": ({"APL_GEMV_ORDER": 3}, {}),
    "order_5": ({"APL_GEMV_ORDER": 5}, {}),  # widest first, decode and tiles
    "order_7": ({"APL_GEMV_ORDER": 7}, {}),
    "order_15": ({"APL_GEMV_ORDER": 15}, {}),  # the 5-8-bit kernel too
    "order_3_waves": ({"APL_GEMV_ORDER": 3}, {"GEMV_WAVE_PLAN_MAX_BITS": 8}),  # + whole waves at any width
    "order_7_stable": ({"APL_GEMV_ORDER": 7}, {"stable": True}),
    "order_1_stable": ({"APL_GEMV_ORDER": 1}, {"stable": True}),
    "order_5_stable": ({"APL_GEMV_ORDER": 5}, {"stable": True}),
    "order_2_stable": ({"APL_GEMV_ORDER": 2}, {"stable": True}),
    "order_0_stable": ({"APL_GEMV_ORDER": 0}, {"stable": True}),
    # the heavy order at 1 token too (the default, 5, takes it from 2 tokens: APL_GEMV_HEAVY_MIN_TOKENS)
    "heavy_all": ({"APL_GEMV_ORDER": 5, "APL_GEMV_HEAVY_MIN_TOKENS": 1}, {}),
    "heavy_all_stable": ({"APL_GEMV_ORDER": 5, "APL_GEMV_HEAVY_MIN_TOKENS": 1}, {"stable": True}),
    # decode launches not planned by whole waves (5-8-bit, merged, stable) split to 2 or 4 waves of
    # CTAs: finer work items, so a launch whose CTAs differ in width ends on a shorter tail
    "wide_2w": ({}, {"GEMV_WIDE_TARGET_CTAS": 1056}),
    "wide_4w": ({}, {"GEMV_WIDE_TARGET_CTAS": 2112}),
    "wide_2w_stable": ({}, {"GEMV_WIDE_TARGET_CTAS": 1056, "stable": True}),
    "wide_4w_stable": ({}, {"GEMV_WIDE_TARGET_CTAS": 2112, "stable": True}),
    # decode launches with shared LUT rows: the split capped so 4 CTAs fit an SM (GEMV_LUT_AWARE_CTAS;
    # measured 6-27% slower, off), and uncapped as by default (the run of 1fe6f5e, where 4 was base)
    "lut_aware": ({}, {"GEMV_LUT_AWARE_CTAS": 4}),
    "lut_aware_stable": ({}, {"GEMV_LUT_AWARE_CTAS": 4, "stable": True}),
    "lut_unaware": ({}, {"GEMV_LUT_AWARE_CTAS": 0}),
    "lut_unaware_stable": ({}, {"GEMV_LUT_AWARE_CTAS": 0, "stable": True}),
    # the plane words' loads with cache qualifiers (APL_PLANE_HINT): L1::no_allocate, L2::256B, both, no_allocate
    # with L2::128B, in every instance (run at dfa916b as `base hint_1 hint_2 hint_3 hint_5 stable stable_hint_1
    # stable_hint_3 pdl_merged stable_pdl_merged --hint`, base = no hint); the default since: L2::256B in the tiles
    # instances of 64-token passes (APL_PLANE_HINT_MIN_NT8 8; `base hint_0 hint_nt4 hint_2 --tiles`)
    "hint_0": ({"APL_PLANE_HINT": 0}, {}),
    "hint_1": ({"APL_PLANE_HINT": 1, "APL_PLANE_HINT_MIN_NT8": 1}, {}),
    "hint_2": ({"APL_PLANE_HINT": 2, "APL_PLANE_HINT_MIN_NT8": 1}, {}),
    "hint_3": ({"APL_PLANE_HINT": 3, "APL_PLANE_HINT_MIN_NT8": 1}, {}),
    "hint_5": ({"APL_PLANE_HINT": 5, "APL_PLANE_HINT_MIN_NT8": 1}, {}),
    "hint_nt4": ({"APL_PLANE_HINT": 2, "APL_PLANE_HINT_MIN_NT8": 4}, {}),  # tiles from 32 tokens a pass
    "stable_hint_0": ({"APL_PLANE_HINT": 0}, {"stable": True}),
    "stable_hint_1": ({"APL_PLANE_HINT": 1, "APL_PLANE_HINT_MIN_NT8": 1}, {"stable": True}),
    "stable_hint_3": ({"APL_PLANE_HINT": 3, "APL_PLANE_HINT_MIN_NT8": 1}, {"stable": True}),
    # the 5-8-bit and merged decode kernels' down launched programmatically too, their shared LUT
    # rows filled after the wait for h (APL_GEMV_PDL_LUT_WAIT): under stable launches a 3-4-bit
    # layer's down then overlaps gate_up as the 3-4-bit kernel's does (dfa916b: Mixtral 1 token 8 bits +6%, stable
    # Qwen1.5-MoE 4 bits -7..-10%, stable Mixtral 3-4 bits +1..+3%; left off)
    "pdl_merged": ({"APL_GEMV_PDL_LUT_WAIT": 1}, {"GEMV_PDL_DOWN_CLASSES": (0, 1, 2)}),
    "stable_pdl_merged": ({"APL_GEMV_PDL_LUT_WAIT": 1}, {"GEMV_PDL_DOWN_CLASSES": (0, 1, 2), "stable": True}),
    # decode launches of long rows on the instances compiled with L2::256B plane loads (GEMV_LONG_*:
    # every class, splits of 64+ words, rows of 128+, from 2 tokens by default). The first run (211e33c:
    # `base long_off long_merged long_w128 stable stable_long_off --long`) had every decode launch of 64+
    # words hinted, which is `long_any` here
    "long_off": ({}, {"GEMV_LONG_SPLIT_CLASSES": ()}),  # no decode launch hinted (before 2026-12-03, third session)
    "long_any": ({}, {"GEMV_LONG_ROW_WORDS": 0, "GEMV_LONG_MIN_TOKENS": 1}),  # any row, 1 token too
    "long_merged": ({}, {"GEMV_LONG_SPLIT_CLASSES": (2,)}),  # the merged kernel's launches only
    "long_w128": ({}, {"GEMV_LONG_SPLIT_WORDS": 128}),  # splits of 512 bytes a row and plane and more
    "stable_long_off": ({}, {"GEMV_LONG_SPLIT_CLASSES": (), "stable": True}),
    # 5-bit LUT rows in rooms of 64+ entries (merged, stable and wider 5-8-bit launches) not staggered
    # (APL_LUT_STAGGER 0: every row from bank 0; `base stagger_off stable stable_stagger_off --long`)
    "stagger_off": ({"APL_LUT_STAGGER": 0}, {}),
    "stable_stagger_off": ({"APL_LUT_STAGGER": 0}, {"stable": True}),
}
MIXED_SHAPES = [("qwen1.5-moe-a2.7b", 1, "mixed"), ("qwen1.5-moe-a2.7b", 4, "mixed"), ("mixtral-8x7b", 1, "mixed"),
                ("mixtral-8x7b", 4, "mixed"), ("qwen1.5-moe-a2.7b", 1, "4")]
DECODE_SHAPES = [(name, T, bits) for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b") for T, bits in
                 ((1, "3"), (1, "4"), (1, "8"), (1, "mixed"), (4, "3"), (4, "4"), (4, "mixed"), (16, "4"))]
COMPACT_SHAPES = [("qwen1.5-moe-a2.7b", 1, "3"), ("qwen1.5-moe-a2.7b", 1, "4"), ("qwen1.5-moe-a2.7b", 4, "4"),
                  ("qwen1.5-moe-a2.7b", 1, "mixed"), ("mixtral-8x7b", 1, "4"), ("mixtral-8x7b", 4, "4")]
# --merged: the shapes that run the merged kernel (mixed bits; any bits with stable launches)
MERGED_SHAPES = [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T, bits in
                 ((1, "4"), (1, "mixed"), (4, "mixed"))]
# --fused: the shapes the one-launch decode runs (3-4 bits, 1-16 tokens) and one it does not
# (mixed bits: two launches in both variants, the noise check)
FUSED_SHAPES = [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T, bits in
                ((1, "3"), (1, "4"), (2, "4"), (4, "3"), (4, "4"), (16, "4"), (1, "mixed"))]
# --waves: the decode shapes whose column splits _wave_splits changed, and two it left alone
WAVE_SHAPES = [("mixtral-8x7b", 1, "3"), ("mixtral-8x7b", 1, "4"), ("mixtral-8x7b", 1, "8"), ("mixtral-8x7b", 1, "mixed"),
               ("mixtral-8x7b", 2, "4"), ("mixtral-8x7b", 4, "4"), ("qwen1.5-moe-a2.7b", 2, "4"),
               ("qwen1.5-moe-a2.7b", 4, "4"), ("qwen1.5-moe-a2.7b", 1, "4"), ("qwen1.5-moe-a2.7b", 16, "4")]
TILES_SHAPES = [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (64, 256)
                for bits in ("4", "8")] + [("mixtral-8x7b", 256, "mixed")]
# --order: the shapes whose launches hold blocks of several widths (mixed bits, decode and tiles)
# and a uniform 8-bit one (one width: the order is the natural one, so only its cost shows)
ORDER_SHAPES = [(name, T, "mixed") for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (1, 4, 16, 64, 256)] + \
               [("mixtral-8x7b", 1, "8"), ("mixtral-8x7b", 16, "8"), ("mixtral-8x7b", 1, "4"), ("qwen1.5-moe-a2.7b", 1, "4")]
# and, timed under the first variant only (a uniform layer launches no merged kernel, so no order
# variant changes it), each width the mixed layers hold at 1-16 tokens: their byte-weighted time
UNIFORM_FOR_WEIGHTS = [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (1, 4, 16)
                       for bits in ("3", "4", "5", "6", "8")]
# --lut: the decode shapes GEMV_LUT_AWARE_CTAS changes (8-bit LUT rows from 2 tokens: mixed, uniform 8
# bits, and every width under stable launches), with a 1-token control, and the byte-weighted rows
LUT_SHAPES = [(name, T, "mixed") for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (1, 4, 16)] + \
             [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T, bits in
              ((1, "8"), (4, "8"), (16, "8"), (4, "4"), (16, "4"))] + [("mixtral-8x7b", 2, "8")]
# --hint: decode (3-4 / 8 / mixed bits, 1-16 tokens) and tiles (64 / 256 tokens) shapes at both sizes,
# with the mixed layers' byte-weighted rows
HINT_SHAPES = [(name, T, bits) for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b") for T, bits in
               ((1, "3"), (1, "4"), (1, "8"), (1, "mixed"), (4, "4"), (4, "mixed"), (16, "4"), (16, "mixed"),
                (64, "4"), (256, "4"))] + [("mixtral-8x7b", 256, "8")]
# --long: every decode width at 1, 4 and 16 tokens at both sizes (the long-split variants change uniform
# layers too, so each variant weighs its mixed layers' bytes with its own uniform rates), 2 and 8 tokens at
# 4 bits, and 4 bits at 1 and 16 tokens (the stable variants: the merged kernel at one width)
LONG_SHAPES = [(name, T, bits) for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b") for T in (1, 4, 16)
               for bits in ("3", "4", "5", "6", "8", "mixed")] + \
              [(name, T, "4") for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b") for T in (2, 8)]
# --staged: 3-4-bit layers from 32 to 1024 tokens (where the staged regime beats the tiles and prefill
# regimes), and the 8-bit and mixed tiles shapes
STAGED_SHAPES = [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (32, 64, 128, 256, 512, 1024)
                 for bits in ("3", "4")] + [(name, T, bits) for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (64, 256)
                                            for bits in ("8", "mixed")]
# --tiles-mixed: the tiles shapes at mixed bits (the merged kernel against one launch per class)
TILES_MIXED_SHAPES = [(name, T, "mixed") for name in ("qwen1.5-moe-a2.7b", "mixtral-8x7b") for T in (64, 256)]


def set_variant(vname):
    defines, host = VARIANTS[vname]
    op.KERNEL_DEFINES.clear()
    op.KERNEL_DEFINES.update(BASE, **defines)
    for knob, value in HOST_KNOBS.items():
        setattr(op, knob, host.get(knob, value))


def compile_decode_instances(variants, device, both_dtypes=False, tiles=(1,)):
    """The decode instances with 8-byte plane loads (every class, both projections, and the
    fused launch; bf16, or with both_dtypes fp16 and 4-byte loads too) of each variant, in threads
    (tiles: the NT8 values; (2, 4, 8) for the tiles regime). cupy keeps them in its disk cache
    (and compile_for_arch the sm_90a ones in its own), so a later process (the GPU tests) finds
    them compiled."""
    import cupy as cp

    layouts = [(f, a) for f in ("true", "false") for a in ("true", "false")] if both_dtypes else [("true", "true")]
    keys = []
    for vname in variants:
        set_variant(vname)
        keys += [(op._gemv_name(cls, mode, flag, aligned, nt8), op._defines("silu"))
                 for cls in (0, 1, 2) for mode in (0, 1) for flag, aligned in layouts for nt8 in tiles]
        if 1 in tiles:  # the long-split decode instances
            keys += [(op._gemv_name(cls, mode, flag, aligned, 1, True), op._defines("silu"))
                     for cls in op.long_split_classes() for mode in (0, 1) for flag, aligned in layouts]
        keys += [(op._fused_name(cls, flag, aligned), op._defines("silu"))
                 for cls in op.FUSED_CLASSES for flag, aligned in layouts]

    def compile_one(key):
        with cp.cuda.Device(device.index or 0):
            op._compiled(*key)

    keys = list(dict.fromkeys(keys))  # variants that differ only in host knobs share their instances
    with ThreadPoolExecutor(max_workers=min(16, len(keys))) as pool:
        list(pool.map(compile_one, keys))


def add_byte_weighted_rows(rows, cases):
    """Each mixed row at 1-16 tokens against its byte-weighted time (bench/apl_moe_kernel.py's
    add_byte_weighted: each width's share of the mixed layer's bytes at that width's uniform rate,
    the uniform rows of this process: the row's own variant's where it timed that width, else the
    first variant's); printed and added to the row."""
    first = rows[0]["variant"]  # (the uniform shapes of ORDER_SHAPES are timed under every variant)
    timed: dict[str, dict[tuple, float]] = {}  # variant -> {(model, tokens, bits): us} of its uniform rows
    for r in rows:
        if r["bits"] != "mixed":
            timed.setdefault(r["variant"], {})[(r["model"], r["tokens"], r["bits"])] = r["us"]
    for r in rows:
        if r["bits"] != "mixed" or r["tokens"] > 16:
            continue
        uniform = {**timed.get(first, {}), **timed.get(r["variant"], {})}
        model, T = r["model"], r["tokens"]
        route, apl = cases[(model, T, "mixed")][1:]
        active = [ids.unique().tolist() for ids, _ in route]
        shares: dict[int, float] = {}
        for i, experts in enumerate(active):
            for bits, nbytes in apl[i % COPIES].nbytes_by_width(experts).items():
                shares[bits] = shares.get(bits, 0.0) + nbytes / len(route)
        predicted = 0.0
        for bits, nbytes in shares.items():
            key = (model, T, str(bits))
            width_layers = cases[key][2]
            width_bytes = sum(width_layers[i % COPIES].nbytes_active(a) for i, a in enumerate(active)) / len(route)
            predicted += nbytes * uniform[key] / width_bytes
        r["byte_weighted_us"] = round(predicted, 1)
        r["over_byte_weighted"] = round(r["us"] / predicted, 3)
        print(f"{r['variant']:16s} {model:18s} T={T:3d} mixed {r['us']:.1f} us, byte-weighted {predicted:.1f} us: "
              f"{r['over_byte_weighted']:.3f}x", flush=True)


def main():
    device = torch.device("cuda")
    if "--compile-only" in sys.argv:
        compile_decode_instances([a for a in sys.argv[1:] if a in VARIANTS], device, both_dtypes=True)
        print(op.compile_stats())
        return
    tiles_run = "--tiles" in sys.argv or "--tiles-mixed" in sys.argv or "--staged" in sys.argv
    shapes = MIXED_SHAPES if "--mixed" in sys.argv else TILES_SHAPES if "--tiles" in sys.argv \
        else STAGED_SHAPES if "--staged" in sys.argv \
        else TILES_MIXED_SHAPES if "--tiles-mixed" in sys.argv \
        else DECODE_SHAPES if "--decode" in sys.argv else FUSED_SHAPES if "--fused" in sys.argv \
        else COMPACT_SHAPES if "--compact" in sys.argv else MERGED_SHAPES if "--merged" in sys.argv \
        else WAVE_SHAPES if "--waves" in sys.argv else ORDER_SHAPES if "--order" in sys.argv \
        else LUT_SHAPES if "--lut" in sys.argv else HINT_SHAPES if "--hint" in sys.argv \
        else LONG_SHAPES if "--long" in sys.argv else SHAPES
    if "--only-shapes" in sys.argv:  # model:tokens:bits,... (a subset of the chosen shapes)
        wanted = {tuple(spec.split(":")) for spec in sys.argv[sys.argv.index("--only-shapes") + 1].split(",")}
        shapes = [s for s in shapes if (s[0], str(s[1]), s[2]) in wanted]
    weighed = "--order" in sys.argv or "--lut" in sys.argv or "--hint" in sys.argv or "--long" in sys.argv
    once = [s for s in UNIFORM_FOR_WEIGHTS if s not in shapes] if weighed else []
    names = sorted({s[0] for s in shapes + once})
    layers = {name: [SyntheticLayer(*MODELS[name][:1], *MODELS[name][2:], seed, device) for seed in range(COPIES)]
              for name in names}
    cases = {}
    for name, T, bits in shapes + once:
        E, k, H, I = MODELS[name]
        apl = [layer.apl(bit_assignment(bits, E, 17)) for layer in layers[name]]
        route = routings(T, E, k, REPS, device, seed=T)
        x = [torch.randn(T, H, device=device).bfloat16() for _ in range(REPS)]
        cases[(name, T, bits)] = (x, route, apl)
    only = [a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS)
    if any(a in sys.argv for a in ("--decode", "--fused", "--compact", "--merged", "--waves", "--order", "--lut", "--hint",
                                   "--long")):
        compile_decode_instances(only, device)
    if tiles_run or "--order" in sys.argv or "--hint" in sys.argv:
        compile_decode_instances(only, device, tiles=op.tiles_choices(1)[1:])  # (the 3-4-bit wide passes compile at first use)
    rows = []
    for vname in only:
        set_variant(vname)
        _, host = VARIANTS[vname]
        for shape in shapes + (once if vname == only[0] else []):
            x, route, apl = cases[shape]
            for layer in apl:
                layer._summarise()
                if "aligned8" in host:
                    layer.aligned8 = {m: host["aligned8"] for m in layer.aligned8}
                layer.stable_launches = host.get("stable", False)
            calls = [lambda c=i % COPIES, i=i: op.apl_moe(x[i], *route[i], apl[c]) for i in range(REPS)]
            us = time_calls(calls)
            rows.append({"variant": vname, "model": shape[0], "tokens": shape[1], "bits": shape[2], "us": round(us, 1)})
            print(f"{vname:16s} {shape[0]:18s} T={shape[1]:3d} bits={shape[2]:5s} {us:8.1f} us", flush=True)
    if weighed:
        add_byte_weighted_rows(rows, cases)
    if "--json" in sys.argv:
        name = sys.argv[sys.argv.index("--json") + 1]
        print(write_result(name, {"command": "python3 -m bench.apl_gemv_variants " + " ".join(sys.argv[1:]),
                                  "results": rows}))


if __name__ == "__main__":
    main()
