"""The fused APL MoE operator: launcher for apl_moe.cu / apl_gemv.cu and its torch reference.

`apl_moe(x, topk_ids, topk_weights, layer)` computes one MoE layer's routed experts
straight from bit-planes and LUTs, every block at its own bit-width, on PyTorch's current
stream with no host synchronisation: at decode (few tokens per expert) and in the tiles
regime (up to TILES_MAX_TOKENS_PER_EXPERT) in two launches on tensor cores (apl_gemv.cu's
header), beyond that in four (apl_moe.cu's header).
`apl_moe_reference` is the same function in plain torch: dequantise each block with
`pagedweight.format.apl_format.dequantize` (the one definition of the format), round
to x's dtype, and run the reference combine `moe_forward`. Tests compare the two.

A layer is described to the kernel by two int64 descriptor tensors on the GPU (one row per
expert, for `gate_up` and `down`): bits, LUT address and one address per plane, so every
plane may live anywhere in the memory pool and a page-table commit only rewrites a row.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedweight_kernels.cuda_packages import compile_for_arch, cuda_with, launch_on_torch_stream, module_source
from pagedweight_kernels.moe_reference import check_activation, gated, moe_forward
from pagedweight.format.apl_format import (
    COL_ALIGN, LUT_DTYPE, MAX_BITS, MIN_BITS, APLBlock, check_bits, dequantize, lut_entries,
)

SOURCE = Path(__file__).with_name("apl_moe.cu")
GEMV_SOURCE = Path(__file__).with_name("apl_gemv.cu")  # compiled after SOURCE (uses its helpers)
STAGED_SOURCE = Path(__file__).with_name("apl_staged.cu")  # compiled after both (uses their helpers)
DESC_WIDTH = 10  # int64 per block: bits, LUT address, 8 plane addresses (kept in step with the .cu)
DESC_BITS, DESC_LUT, DESC_PLANES = 0, 1, 2
MAX_EXPERTS = 1024  # moe_align's shared counters
ACT_DTYPES = (torch.bfloat16, torch.float16)

# Regime choice (per launch, from the host-known average tokens per expert, T*k/E).
DECODE_MAX_TOKENS_PER_EXPERT = 2.0  # above: tensor-core prefill kernel
PREFILL_TILES = ((12.0, 16), (40.0, 32), (80.0, 64))  # (up to this many tokens per expert, tile)
PREFILL_LARGEST_TILE = 128  # above the last limit
DECODE_X_BYTES = 32 * 1024  # shared-memory budget for one column split's activations
SMEM_ALIGN_PAD = 1024  # kernels round their shared memory start up to 1 KB (aligned LUT rows)
PREFILL_ROWS, PREFILL_SP = 64, 136  # weight rows per prefill CTA; padded shared row (u16)
THREADS = 256
# The tensor-core decode kernel (apl_gemv.cu): two launches per layer and bit-width class.
GEMV_MAX_TOKENS_PER_EXPERT = 4.0  # above: the prefill kernel; a hot expert takes passes of 8
GEMV_ROWS, GEMV_THREADS, GEMV_STEP_WORDS, GEMV_TOKENS = 64, 128, 8, 8
GEMV_TARGET_CTAS = 528  # one wave on a 132-SM H200 (4 CTAs per SM): longer CTAs, fewer prologues
# Decode launches not planned by whole waves (5-8-bit, merged and stable ones, whose CTAs may
# differ in width, so in length) split to about this many CTAs; 2 and 4 waves (finer work items
# for a shorter tail) were measured no better overall (H200, apl_gemv_order_default.json).
GEMV_WIDE_TARGET_CTAS = 528
GEMV_X_BYTES = 40 * 1024  # shared memory for one split's staged activations
# With GEMV_LUT_AWARE_CTAS n, a decode launch that reserves shared LUT rows (5-8-bit, merged and
# stable launches) stages at most what leaves room for n CTAs per SM (GEMV_SM_SHARED bytes, 1 KB
# reserved per CTA). Off (0): the staging budget alone decides, so 8-bit LUT rows leave 3 CTAs per
# SM from 2 tokens up; measured, 4 with the splits that takes was 6-27% slower at 2-16 tokens
# (H200, bench/results/apl_gemv_lut_aware.json, docs/kernel.md): occupancy is not what binds them.
GEMV_LUT_AWARE_CTAS = 0
GEMV_SM_SHARED = 228 * 1024
GEMV_STATIC_SHARED = 512  # the kernel's own __shared__ (present, scratch, flags: ~170 bytes), rounded up
GEMV_MIN_SPLIT_WORDS = 16  # a split covers at least two warp steps
# Decode column splits of 3-4-bit layers chosen by whole waves (_wave_splits): a grid of 1.21
# waves (Mixtral's down at 1 token, 5 splits: 640 CTAs) ends with one CTA per SM. Measured
# (H200, bench/results/apl_gemv_waves.json): Qwen1.5-MoE 2 tokens 5% and 4 tokens 2% faster,
# Mixtral 3 bits 2.4% and 2 tokens 1.9% faster, Mixtral 1 token 4 bits unchanged.
GEMV_WAVE_PLAN = True
GEMV_WAVE_PLAN_MAX_BITS = 4  # the whole-wave plan for layers up to this width (the register-LUT kernel)
GEMV_CTA_FIXED_STEPS = 2  # a CTA's prologue and epilogue (route, descriptor, LUT, reduction) in warp steps
GEMV_MAX_ASSIGN = 4096  # tokens * top_k a CTA's shared slot list holds
GEMV_MERGE_CLASSES = True  # a layer with 3-4- and 5-8-bit blocks: one launch per projection (measured faster)
# Unused dynamic shared memory added to every decode launch (NT8 1; gemv_extra_shared): 0 in service. A tuning
# knob (bench/apl_gemv_variants.py `shared_pad`): the 3-4-bit kernel given the merged kernel's
# 8-bit LUT room tells whether that room (the shared-memory carveout it takes from L1) is what
# makes stable launches slower at 3-4 bits (docs/elasticity.md: 1.07-1.21x in the engine; the
# layer alone, docs/kernel.md: 18-20% at 1 token, 22-29% at 4-16 tokens; about a third of it at
# Mixtral size and 1 token is the room).
GEMV_SHARED_PAD = 0
# Decode of a layer whose blocks are all 3-4 bits: gate_up and down in one launch
# (apl_gemv_fused: a work ticket per CTA, down CTAs wait on per-row-tile flags for their h
# words). APL_GEMV_FUSED=1 in the environment turns it on.
GEMV_FUSED = os.environ.get("APL_GEMV_FUSED", "0") == "1"  # measured slower (docs/kernel.md): off by default
# Programmatic dependent launch of the decode and tiles projections (sm_90+, with the .cu's
# APL_GEMV_PDL, which compiles in the waits): 1 = down may start while gate_up finishes (its
# routing, descriptor, LUT and first planes before it waits for h); 2 = gate_up too, after whatever
# kernel precedes it (it waits before reading anything). 0 = every launch waits for the one before.
# Down launches only where programmatic_down says (the 3-4-bit decode kernel and the tiles regime).
# Measured (H200, bench/results/apl_gemv_pdl.json): 1 is 3-6% faster at Qwen1.5-MoE decode, 1-3%
# in the tiles regime, 2% at Mixtral 1 token, level at Mixtral 4 tokens; 2 no better than 1.
GEMV_PDL = 1
# The decode kernel classes whose down launch is programmatic (programmatic_down): the 3-4-bit
# kernel's. The 5-8-bit and merged down CTAs fill their shared LUT rows as they start, which took
# DRAM from gate_up's last CTAs (slower, docs/kernel.md). With every class and those rows filled
# after the wait (APL_GEMV_PDL_LUT_WAIT 1), measured on the H200 (bench/results/apl_gemv_hint_dfa916b.json):
# Mixtral 1 token 8 bits 6% slower, stable launches of Qwen1.5-MoE 4-bit layers 7-10% faster but
# of Mixtral's 3% slower: left at the 3-4-bit kernel.
GEMV_PDL_DOWN_CLASSES = (0,)
# Decode launches (NT8 1) of these kernel classes over long rows take the instance compiled for long
# splits (apl_gemv's LONG): its plane loads carry APL_PLANE_HINT's L2::256B, so a row's first load in
# each 256 bytes has L2 fetch the rest of them for the warp's next steps. Long: a split of at least
# GEMV_LONG_SPLIT_WORDS words (64 words are 256 bytes a row and plane, so the fetch never overshoots
# the split), rows of at least GEMV_LONG_ROW_WORDS, and at least GEMV_LONG_MIN_TOKENS tokens staged.
# Measured (H200, bench/results/apl_gemv_long_211e33c.json, every decode launch of 64+ words hinted):
# Mixtral-size layers (rows of 128 and 448 words) at 4-16 tokens 1-6% faster at every width (mixed 5%
# and 3.5%, 8 bits 6%), at 1 token 1-3% slower at 4-6 bits; Qwen1.5-MoE's 64-word gate_up rows level
# to 3% slower at 3-6 bits; the rule as set here in bench/results/apl_gemv_long_rule_c697377.json
# (stable launches of 3-4-bit layers at Mixtral 4 tokens 6-9% faster too). Chosen from the plan
# (shapes, tokens), never from the bits, so stable launches keep their instances.
GEMV_LONG_SPLIT_CLASSES = (0, 1, 2)
GEMV_LONG_SPLIT_WORDS = 64
GEMV_LONG_ROW_WORDS = 128
GEMV_LONG_MIN_TOKENS = 2
# The tiles regime (apl_gemv.cu with NT8 > 1): the decode kernel's register-LUT dequantisation,
# each weight's fragments reused for up to 8 * NT8 tokens per pass.
TILES_MAX_TOKENS_PER_EXPERT = 128.0  # above: the prefill kernel (apl_moe.cu)
TILES_MIN_NT8, TILES_MAX_NT8 = 2, 8  # the .cu's accumulators: 4 fp32 registers per 8-token tile
TILES_HEADROOM = 1.5  # a pass holds 1.5x the mean tokens per expert (routing is uneven)
# Layers of 3-4-bit blocks whose passes want more than TILES_MAX_NT8 tiles, and at most this many,
# take passes of TILES_WIDE_NT8 tiles (96 tokens: 48 accumulators a thread, 2 CTAs per SM), so an
# expert a little over the mean (Mixtral-size prefill at 256 tokens: 46-82 tokens an expert, 12
# passes of 64 for 8 experts) is dequantised once, not twice (8 passes of 96). Measured (H200,
# bench/results/apl_gemv_wide_04ad757.json, one process): Mixtral 256 tokens 4 bits 1484.1 ->
# 1441.2 us; no other benchmarked shape takes it. Past 12 tiles wanted, passes of 96 save no pass
# over passes of 64 at 1.5x the mean and hold fewer CTAs, so the powers of two keep those. 0: off
# (the NT8 12 instances are then not compiled).
TILES_WIDE_NT8 = 12
# The staged regime (apl_staged.cu, sm_90a): a producer warpgroup dequantises plane tiles into a
# ring of shared-memory buffers while a consumer warpgroup runs wgmma with both operands there,
# in the four-launch path (moe_align, gate_up, down, moe_combine). Taken for the calls the tiles
# and prefill regimes would take, on a compute-capability 9.0 GPU, outside stable launches
# (use_staged): by default for layers whose blocks are all 3-4 bits (STAGED_CLASSES) at
# STAGED_MIN_ASSIGNMENTS or more (token, expert) assignments; for every layer where STAGED_PREFILL
# is on (APL_STAGED_PREFILL=1; =0 turns the default rule off too). Measured (H200, one process,
# bench/results/apl_gemv_staged_sweep.json, 2026-12-05): with the plane ring, 3-4 bits, staged
# against the tiles and prefill regimes: Qwen1.5-MoE 64-1024 tokens 1.00x-2.06x faster, Mixtral
# 128-1024 tokens 1.04x-2.1x faster, Mixtral 32 and 64 tokens (64 and 128 assignments) 1.03x-1.21x
# slower; 8 bits 1.6x-3.1x slower (the 5-8-bit producers' shared-memory LUT lookups). Since
# 2026-12-05 (fourth session; H100, one process, bench/results/apl_gemv_staged_lut_one.json) the
# 5-8-bit and merged classes take it too (STAGED_LUT_MIN_PER_EXPERT, below): with lane-banked LUT
# rows, one CTA an SM and passes of 128 tokens, Mixtral 256 tokens 8 bits 1774.6 against the tiles
# regime's 2757.6 us, mixed 1350.9 against 1863.3; Qwen1.5-MoE 256 tokens (1024 assignments) 8 bits
# 738.6 against 765.7, mixed 480.2 against 567.9; at 128 and 256 assignments (Mixtral and Qwen1.5-MoE
# 64 tokens) the tiles regime was faster (1384.3 against 1447.0, 554.1 against 713.2) until the plane
# words came by cp.async too (STAGED_LUT_MIN_PER_EXPERT).
_STAGED_ENV = os.environ.get("APL_STAGED_PREFILL", "")
STAGED_PREFILL = _STAGED_ENV == "1"
STAGED_CLASSES = frozenset() if _STAGED_ENV == "0" else frozenset({0, 1})
STAGED_MIN_ASSIGNMENTS = 256
# Layers with 5-8-bit blocks (class 1 alone or merged) from STAGED_LUT_MIN_PER_EXPERT assignments an
# expert (their plane words by cp.async, 62cc15a, H100, apl_gemv_staged_lut_pa.json: Mixtral 64 tokens
# 8 bits, 16 an expert, staged 1309.0 against the tiles regime's 1402.6 us; Qwen1.5-MoE 256 tokens, 17,
# 668.6 against 743.2; Qwen1.5-MoE 64 tokens, 4.3, 646.6 against 551.8, so the tiles regime there).
STAGED_LUT_MIN_PER_EXPERT = 16
# Passes of 8 * STAGED_WIDE_NT8 tokens for 3-4-bit layers in the staged regime (16: 128 tokens, the
# consumer's m64n128 accumulators), where more than TILES_WIDE_NT8 and at most STAGED_WIDE_NT8 tiles
# are wanted and the planes are read as 16-byte vectors (one pass instead of two of 64 tokens).
# Timed 2026-12-05 (bench/results/apl_gemv_staged_wide16.json, H200): Qwen1.5-MoE 1024 tokens 16-18%
# faster; in place of the 96-token passes too it was 1-1.5% slower at Mixtral 256 tokens, so those
# keep 96. 0: off (the instances are not compiled).
STAGED_WIDE_NT8 = 16
# The same for the 5-8-bit and merged classes (0: off), with the planes read as 16-byte vectors: at
# Mixtral 256 tokens 8 bits 1774.6 against 2244.5 us in passes of 64 (H100, apl_gemv_staged_lut_one.json).
STAGED_LUT_WIDE_NT8 = 16
STAGED_ROWS, STAGED_STEP = 128, 64  # the .cu's ST_ROWS, ST_KS
STAGED_STAGES, STAGED_MAX_STAGES = 4, 8  # ring buffers wanted (fewer where shared memory is short); the .cu's most
# Dynamic shared memory a CTA may take for 2 CTAs per SM (228 KB an SM, 1 KB reserved per CTA, the
# kernel's 128 bytes of static mbarriers), and for 1; the kernel starts it on a 512-byte boundary
# (staged_align: an 8-bit LUT row's), 1024 where TMA writes B tiles (staged_align_pad).
STAGED_CTA_SHARED = (GEMV_SM_SHARED // 2 - 1024 - 128, 227 * 1024 - 128)
STAGED_ALIGN_PAD = 512


def staged_tma(cls: int) -> bool:
    """Whether staged launches of kernel class `cls` take their activations by TMA (the .cu's
    staged_tma: APL_STAGED_TMA 1, the 3-4-bit class only; 2, every class)."""
    return KERNEL_DEFINES["APL_STAGED_TMA"] == 2 or (KERNEL_DEFINES["APL_STAGED_TMA"] == 1 and cls == 0)


def staged_blocks(cls: int) -> int:
    """CTAs an SM the staged instances of kernel class `cls` are compiled for (the .cu's staged_blocks:
    APL_STAGED_BLOCKS for the 3-4-bit class, APL_STAGED_LUT_BLOCKS for the others)."""
    return KERNEL_DEFINES["APL_STAGED_BLOCKS" if cls == 0 else "APL_STAGED_LUT_BLOCKS"]


def staged_producers(cls: int) -> int:
    """Producer warpgroups in a staged CTA of kernel class `cls` (the .cu's staged_producers: one for
    the 3-4-bit class, APL_STAGED_LUT_PRODUCERS for the others)."""
    return 1 if cls == 0 else KERNEL_DEFINES["APL_STAGED_LUT_PRODUCERS"]


def staged_threads(cls: int) -> int:
    """A staged CTA's threads (the .cu's staged_threads): the consumer warpgroup and the producers'."""
    return 128 * (1 + staged_producers(cls))


def staged_align_pad(cls: int) -> int:
    """The bytes a staged launch of class `cls` adds for the kernel's staged_align (its dynamic shared
    memory's start, aligned up): 1024 where a TMA-written B tile starts the ring, else 512."""
    return 1024 if staged_tma(cls) else STAGED_ALIGN_PAD


def bit_class(bits: int) -> int:
    """The decode kernel compiled for this width: 0 for 3-4 bits (LUT in registers), 1 for 5-8."""
    return 0 if bits <= 4 else 1


def widest_by_class(widths) -> dict[int, int]:
    """Bit class -> the widest of these widths in it (classes ascending), as APLLayer.classes
    holds them per projection."""
    widest: dict[int, int] = {}
    for bits in widths:
        c = bit_class(bits)
        widest[c] = max(widest.get(c, 0), bits)
    return dict(sorted(widest.items()))


# Compile-time knobs of the .cu (see its header); the host plans with the same values.
KERNEL_DEFINES = {"APL_LDS_MODE": 1, "APL_RPG_DIV": 8, "APL_PREFETCH": 1, "APL_DECODE_MIN_BLOCKS": 2,
                  "APL_SHIFT_MODE": 0, "APL_PREFILL_MIN_BLOCKS": 1, "APL_GEMV_MIN_BLOCKS": 4,
                  "APL_GEMV_L2_PREFETCH": 0, "APL_GEMV_RING_STAGES": 0, "APL_GEMV_PIPE": 2, "APL_GEMV_PIPE_EARLY": 0,
                  "APL_GEMV_COMPACT": 4, "APL_GEMV_ACQREL": 1, "APL_FMA_SHIFTS_MIN_BITS": 4, "APL_PRMT_SELECT": 0, "APL_GEMV_STAGE16": 1, "APL_GEMV_LUT16": 0,
                  "APL_TILES_MIN_BLOCKS": 0, "APL_TILES_GROUP": 4, "APL_TILES_ASYNC": 1, "APL_TILES_WGMMA": 1,
                  "APL_GEMV_BATCHED_LOADS": 1, "APL_TILES_PAIR": 0, "APL_GEMV_PDL": 1, "APL_GEMV_PDL_PREFETCH": 0, "APL_GEMV_PDL_PLANES": 0,
                  "APL_GEMV_ORDER": 5, "APL_GEMV_HEAVY_MIN_TOKENS": 2, "APL_PLANE_HINT": 2, "APL_PLANE_HINT_MIN_NT8": 8, "APL_GEMV_PDL_LUT_WAIT": 0,
                  "APL_LUT_STAGGER": 1, "APL_TILES_WS": 0, "APL_TILES_WS_ROUNDS": 2, "APL_TILES_WS_BLOCKS": 2,
                  "APL_TILES_WS_WARPS": 1, "APL_TILES_WS_STAGES": 2, "APL_STAGED_PREFETCH": 2, "APL_STAGED_UNIT": 2, "APL_STAGED_BLOCKS": 2,
                  "APL_STAGED_REGS": 1, "APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_PRODUCER_FENCE": 1,
                  "APL_STAGED_SKIP_PAD": 1, "APL_STAGED_TMA": 2, "APL_STAGED_LUT_LANES": 1, "APL_STAGED_PREFETCH_LUT": 1,
                  "APL_STAGED_LUT_BLOCKS": 1, "APL_STAGED_PLANE_ASYNC_LUT": 1, "APL_STAGED_LUT_PRODUCERS": 2}


def knob_overrides(text: str) -> dict[str, int]:
    """Knob values from "APL_X=1,APL_Y=0" (the APL_KERNEL_DEFINES environment variable): a
    device run tries a candidate default in the tests and benchmarks without editing the source."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if name not in KERNEL_DEFINES or not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"APL_KERNEL_DEFINES: {item!r} is not NAME=integer for a knob of {sorted(KERNEL_DEFINES)}")
        overrides[name] = int(value)
    return overrides


KERNEL_DEFINES.update(knob_overrides(os.environ.get("APL_KERNEL_DEFINES", "")))
GEMV_RING_STAGE_BYTES = 2 * 4 * 32 * 8  # apl_gemv.cu: one warp step at 4 bits in the cp.async ring
# The .cu's APL_ACT per expert activation (moe_reference.ACTIVATIONS): one compiled module each.
ACT_CODES = {"silu": 0, "gelu_tanh": 1}


class APLKernelError(ValueError):
    """Arguments the fused kernel cannot take (dtype, shape, device, layout)."""


# ---------------------------------------------------------------- the layer description
@dataclass
class ResidentBlock:
    """What the GPU holds of one block at its committed bit-width."""

    bits: int
    planes: list[torch.Tensor]  # planes 0..bits-1, each uint8 [rows, cols/8], contiguous, anywhere
    lut: torch.Tensor  # the stored LUT at `bits` (LUT_3, or LUT_4 from 4 bits up), fp16 [rows, lut_entries(bits)], contiguous

    def __post_init__(self):
        check_bits(self.bits)
        if len(self.planes) != self.bits:
            raise APLKernelError(f"a {self.bits}-bit block needs planes 0..{self.bits - 1}, got {len(self.planes)}")
        rows, packed = self.planes[0].shape
        for p, plane in enumerate(self.planes):
            if plane.dtype != torch.uint8 or tuple(plane.shape) != (rows, packed) or not plane.is_contiguous():
                raise APLKernelError(f"plane {p} must be contiguous uint8 [{rows}, {packed}], got "
                                     f"{plane.dtype} {tuple(plane.shape)}")
            if plane.data_ptr() % 4:
                raise APLKernelError(f"plane {p} must start on a 4-byte boundary (read as uint32 words)")
        if (packed * 8) % COL_ALIGN:
            raise APLKernelError(f"APL blocks need cols % {COL_ALIGN} == 0, got {packed * 8}")
        entries = lut_entries(self.bits)
        if self.lut.dtype != LUT_DTYPE or tuple(self.lut.shape) != (rows, entries) or not self.lut.is_contiguous():
            raise APLKernelError(f"a {self.bits}-bit block's LUT must be contiguous {LUT_DTYPE} [{rows}, {entries}], "
                                 f"got {self.lut.dtype} {tuple(self.lut.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes[0].shape[0], self.planes[0].shape[1] * 8

    @cached_property
    def aligned8(self) -> bool:
        """Every plane 8-byte aligned with an even word count per row (decode's 8-byte loads)."""
        return self.shape[1] % 64 == 0 and all(p.data_ptr() % 8 == 0 for p in self.planes)

    @cached_property
    def aligned16(self) -> bool:
        """Every plane 16-byte aligned with a word count per row divisible by 4 (the staged
        regime's 16-byte plane loads)."""
        return self.shape[1] % 128 == 0 and all(p.data_ptr() % 16 == 0 for p in self.planes)

    @property
    def device(self) -> torch.device:
        return self.lut.device

    def descriptor(self) -> list[int]:
        planes = [p.data_ptr() for p in self.planes] + [0] * (8 - self.bits)
        return [self.bits, self.lut.data_ptr(), *planes]

    def dequantize(self) -> torch.Tensor:
        """fp16 [rows, cols] through the format's reference dequantisation."""
        return dequantize(torch.stack(self.planes), self.lut, self.bits)


def resident_block(block: APLBlock, bits: int, device) -> ResidentBlock:
    """The planes 0..bits-1 and the stored LUT a block reads at `bits`, copied to `device`."""
    planes = [block.planes[p].to(device).contiguous() for p in range(bits)]
    return ResidentBlock(bits, planes, block.lut(bits).to(device).contiguous())


@dataclass
class APLLayer:
    """All routed expert blocks of one MoE layer, as the fused kernel reads them."""

    gate_up: list[ResidentBlock]  # per expert, [2I, H] (gate rows, then up rows)
    down: list[ResidentBlock]  # per expert, [H, I]
    activation: str = "silu"  # act(gate) * up: moe_reference.ACTIVATIONS
    # True: decode launches the merged kernel with the 8-bit LUT size whatever the layer's bits
    # (stable_launches below), so a captured decode graph stays valid across bit changes
    stable_launches: bool = False
    num_experts: int = field(init=False)
    hidden: int = field(init=False)
    intermediate: int = field(init=False)
    gate_up_desc: torch.Tensor = field(init=False)  # int64 [E, DESC_WIDTH] on the blocks' device
    down_desc: torch.Tensor = field(init=False)
    max_bits: int = field(init=False)  # largest committed bit-width: sizes the kernels' shared LUTs
    # per projection: bit class -> widest committed bits in it (decode: one launch per class)
    classes: dict[str, dict[int, int]] = field(init=False)
    # per projection: every plane 8-byte aligned with an even word count (decode: 8-byte loads)
    aligned8: dict[str, bool] = field(init=False)
    # per projection: every plane 16-byte aligned, words per row divisible by 4 (staged: 16-byte loads)
    aligned16: dict[str, bool] = field(init=False)
    counters: torch.Tensor = field(init=False)  # int32 zeros: the decode kernels' last-CTA counters

    def __post_init__(self):
        check_activation(self.activation)
        self.num_experts = len(self.gate_up)
        if not 0 < self.num_experts <= MAX_EXPERTS or len(self.down) != self.num_experts:
            raise APLKernelError(f"need 1..{MAX_EXPERTS} experts with one gate_up and one down block each, "
                                 f"got {len(self.gate_up)} and {len(self.down)}")
        two_i, self.hidden = self.gate_up[0].shape
        self.intermediate = two_i // 2
        for e in range(self.num_experts):
            self._check_block(e, "gate_up", self.gate_up[e])
            self._check_block(e, "down", self.down[e])
        self.refresh()

    def _check_block(self, e: int, module: str, block: ResidentBlock):
        H, I = self.hidden, self.intermediate
        want = (2 * I, H) if module == "gate_up" else (H, I)
        if tuple(block.shape) != want:
            raise APLKernelError(f"expert {e} {module} must be {want[0]}x{want[1]}, got {block.shape}")
        if block.device != self.gate_up[0].device:
            raise APLKernelError(f"expert {e} {module} is on {block.device}, the layer on {self.gate_up[0].device}")

    @property
    def device(self) -> torch.device:
        return self.gate_up[0].device

    def set_block(self, expert: int, module: str, block: ResidentBlock):
        """Point one block at new planes/LUT (a page-table commit) and rewrite its descriptor row."""
        self.set_blocks([(expert, module, block)])

    def set_blocks(self, updates: list[tuple[int, str, ResidentBlock]]):
        """Point several blocks at new planes/LUTs and rewrite their descriptor rows: one
        stream-ordered copy per descriptor tensor and one summary for the whole batch. A row
        at a time cost a synchronising pageable copy and a walk over every block each (0.2 ms
        per row on the H200, seconds when the pager moves hundreds of blocks at once)."""
        for expert, module, block in updates:
            self._check_block(expert, module, block)
        for module in ("gate_up", "down"):
            rows = {e: b for e, m, b in updates if m == module}  # the last update of a row wins
            if not rows:
                continue
            blocks = getattr(self, module)
            for e, b in rows.items():
                blocks[e] = b
            desc = self.gate_up_desc if module == "gate_up" else self.down_desc
            index = torch.tensor(list(rows), dtype=torch.int64)
            values = torch.tensor([b.descriptor() for b in rows.values()], dtype=torch.int64)
            if desc.is_cuda:  # pinned, so the copies queue behind the work in flight without a sync
                index, values = index.pin_memory(), values.pin_memory()
            desc.index_copy_(0, index.to(desc.device, non_blocking=True), values.to(desc.device, non_blocking=True))
        self._summarise()

    def refresh(self):
        """Rebuild both descriptor tensors from the blocks (host -> device copy)."""
        self.gate_up_desc = _descriptors(self.gate_up, self.device)
        self.down_desc = _descriptors(self.down, self.device)
        self._summarise()
        # One counter per (active expert, gate_up row tile) at most; the down launches reuse
        # them (every counter is back at zero when a launch ends). The fused decode launch
        # needs both sets at once, then a ready flag per (active expert, gate_up row tile),
        # a ticket and a done count (fused_counter_words). A layer runs on one stream at a
        # time, as a model's forward does.
        self.counters = torch.zeros(fused_counter_words(self.num_experts, self.hidden, self.intermediate),
                                    dtype=torch.int32, device=self.device)

    def _summarise(self):
        self.max_bits = max(b.bits for b in self.gate_up + self.down)
        self.classes = {}
        for module in ("gate_up", "down"):
            self.classes[module] = widest_by_class(b.bits for b in getattr(self, module))
        self.aligned8 = {m: all(b.aligned8 for b in getattr(self, m)) for m in ("gate_up", "down")}
        self.aligned16 = {m: all(b.aligned16 for b in getattr(self, m)) for m in ("gate_up", "down")}

    def decode_launches(self, module: str) -> list[tuple[int, int]]:
        """(kernel class, widest bits for its shared LUT) per decode launch of one projection."""
        if self.stable_launches:
            return [(2, MAX_BITS)]
        return _class_launches(self.classes[module])

    def launch_signature(self) -> tuple:
        """What the layer's launches bake in beyond its descriptor rows (a CUDA graph of a step
        replays them): widest bits (prefill's shared LUT), per projection the decode kernels
        launched with their LUT sizes, and the plane alignment. Coarser than the bit classes: in
        a layer with both classes one merged launch runs whatever the 3-4-bit class's widest
        width is, so a 3 <-> 4-bit move there changes nothing a graph holds.
        With stable_launches only the alignment is left: decode steps (what graphs capture)
        launch the same merged kernel at any bits, and prefill's widest bits are never captured."""
        if self.stable_launches:
            return "stable", tuple(self.aligned8.values())
        launches = tuple(tuple((cls, widest if cls >= 1 else 0) for cls, widest in self.decode_launches(m))
                         for m in ("gate_up", "down"))
        return self.max_bits, launches, tuple(self.aligned8.values())

    def nbytes_active(self, expert_ids) -> int:
        """Plane + LUT bytes the kernel reads for these experts at their committed bits."""
        return sum(self.nbytes_by_width(expert_ids).values())

    def nbytes_by_width(self, expert_ids) -> dict[int, int]:
        """nbytes_active split by the blocks' committed widths."""
        out: dict[int, int] = {}
        for e in expert_ids:
            for block in (self.gate_up[e], self.down[e]):
                rows, cols = block.shape
                out[block.bits] = out.get(block.bits, 0) + rows * cols * block.bits // 8 + rows * (1 << block.bits) * 2
        return out


def fused_counter_words(max_active: int, hidden: int, intermediate: int) -> int:
    """int32 words of counters the decode kernels use (apl_gemv_fused's layout, the largest):
    gate_up last-split counters and ready flags, max_active x gate_up row tiles each, the
    down counters (one per row tile), a ticket and a done count."""
    gu_tiles, dn_tiles = math.ceil(intermediate / (GEMV_ROWS // 2)), math.ceil(hidden / GEMV_ROWS)
    return 2 * max_active * gu_tiles + dn_tiles + 2


def _descriptors(blocks: list[ResidentBlock], device) -> torch.Tensor:
    return torch.tensor([b.descriptor() for b in blocks], dtype=torch.int64).to(device)


# ---------------------------------------------------------------- the torch reference
def apl_moe_reference(x, topk_ids, topk_weights, layer: APLLayer, weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: dequantise each used block, round to x's dtype, reference combine.
    weight_dtype: round the weights to it first (an fp32 reference of what a bf16 kernel reads)."""

    def weights(block: ResidentBlock, tokens: torch.Tensor) -> torch.Tensor:
        w = block.dequantize()
        return (w.to(weight_dtype) if weight_dtype is not None else w).to(tokens.device, tokens.dtype)

    def expert(e: int, tokens: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(tokens, weights(layer.gate_up[e], tokens)).chunk(2, dim=-1)
        return F.linear(gated(gate, up, layer.activation), weights(layer.down[e], tokens))

    return moe_forward(x, topk_ids, topk_weights, expert, layer.num_experts)


# ---------------------------------------------------------------- launch planning (host only)
@dataclass(frozen=True)
class GemmPlan:
    """How one projection (gate_up or down) is launched."""

    regime: str  # "gemv" (tensor-core decode), "tiles" (the same kernel, 8-token tiles per pass),
    #              "decode" (the first decode kernel, CUDA cores) or "prefill" (dequantised tiles)
    tokens: int  # gemv/tiles: tokens per pass; decode: tokens per pass (NT); prefill: token tile (MT)
    lanes_per_row: int  # decode: lanes sharing one weight row
    rows_per_cta: int  # output rows per CTA (gate_up: h columns)
    splits: int  # column splits (decode down only)
    split_cols: int
    grid: tuple[int, int, int]
    shared_bytes: int  # gemv: without the 5-8-bit class's LUT (added per launch)
    tiles: int = 1  # gemv/tiles/staged: the kernel's NT8, 8-token tiles per pass (> 1: the tiles regime)
    stages: int = 0  # staged: the ring's buffers


@dataclass(frozen=True)
class LaunchPlan:
    gate_up: GemmPlan
    down: GemmPlan
    max_active: int  # upper bound on experts with tokens: min(E, T*k)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def lanes_per_row(words: int) -> int:
    """Lanes per weight row: the widest of 32/16/8/4 keeping >= 90% of lanes busy, else the best."""
    def efficiency(lpr):
        return words / (math.ceil(words / lpr) * lpr)
    for lpr in (32, 16, 8, 4):
        if efficiency(lpr) >= 0.9:
            return lpr
    return max((32, 16, 8, 4), key=efficiency)


def decode_rows_per_cta(lpr: int) -> int:
    """Weight rows per decode CTA (DecodeShape in the .cu): lane groups of `lpr` own max(1, lpr/8) rows."""
    return max(1, lpr // KERNEL_DEFINES["APL_RPG_DIV"]) * (THREADS // lpr)


def plan_launch(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
                max_bits: int, legacy_decode: bool = False, stable_launches: bool = False) -> LaunchPlan:
    """Pick the regime and the grids from host-known sizes only (no look at the routing).
    legacy_decode: the first decode kernel (four launches, CUDA cores), kept as a baseline.
    stable_launches: the layer's decode launches must not depend on its widths (a captured
    graph outlives bit moves; APLLayer.launch_signature), so no plan choice by max_bits."""
    per_expert = num_tokens * top_k / num_experts
    max_active = min(num_experts, num_tokens * top_k)
    # (the tiles regime keeps each token's row offset in x / h as an int32)
    fits_gemv = not legacy_decode and num_tokens * top_k <= GEMV_MAX_ASSIGN \
        and num_tokens * top_k * max(hidden, intermediate) < 2 ** 31
    if fits_gemv and per_expert <= TILES_MAX_TOKENS_PER_EXPERT:
        wide = TILES_WIDE_NT8 if bit_class(max_bits) == 0 and not stable_launches else 0
        nt8 = 1 if per_expert <= GEMV_MAX_TOKENS_PER_EXPERT else tiles_per_pass(per_expert, wide)
        # Whole waves of GEMV_TARGET_CTAS hold for the register-LUT kernel only: the 5-8-bit
        # class's shared LUT rows leave fewer CTAs per SM (measured: the wave plan made
        # Mixtral's mixed layer 5% slower and changed 8 bits by < 1%).
        waves = GEMV_WAVE_PLAN and nt8 == 1 and max_bits <= GEMV_WAVE_PLAN_MAX_BITS and not stable_launches
        # the LUT rows the decode launches reserve: the widest 5-8-bit block's (the merged
        # kernel's 8-bit room under stable launches), none for a 3-4-bit layer
        lut_bits = MAX_BITS if stable_launches else max_bits if bit_class(max_bits) == 1 else 0
        gate_up = _gemv_plan(0, num_tokens, top_k, hidden, intermediate, max_active, nt8, waves, lut_bits)
        down = _gemv_plan(1, num_tokens, top_k, intermediate, hidden, max_active, nt8, waves, lut_bits)
    elif legacy_decode and per_expert <= DECODE_MAX_TOKENS_PER_EXPERT:
        nt = 1 if num_tokens == 1 else 2  # activations live in registers: a second token is nearly free
        gate_up = _decode_plan(0, nt, hidden, intermediate, max_bits, max_active)
        down = _decode_plan(1, nt, intermediate, hidden, max_bits, max_active)
    else:
        mt = next((tile for limit, tile in PREFILL_TILES if per_expert <= limit), PREFILL_LARGEST_TILE)
        z = max(1, min(math.ceil(num_tokens / mt), math.ceil(per_expert / mt)))
        gate_up = _prefill_plan(0, mt, intermediate, max_bits, max_active, z)
        down = _prefill_plan(1, mt, hidden, max_bits, max_active, z)
    return LaunchPlan(gate_up, down, max_active)


def _decode_plan(mode, nt, cols, rows_out, max_bits, max_active) -> GemmPlan:
    # gate_up keeps whole rows (its epilogue needs complete gate and up sums); down splits
    # long rows so one split's activations fit the shared-memory budget.
    splits = 1 if mode == 0 else max(1, math.ceil(cols * nt * 4 / DECODE_X_BYTES))
    split_cols = math.ceil(cols / splits / 32) * 32
    splits = math.ceil(cols / split_cols)
    kw = split_cols // 32
    lpr = lanes_per_row(kw)
    rows_w = decode_rows_per_cta(lpr)
    rpc = rows_w // 2 if mode == 0 else rows_w
    shared = SMEM_ALIGN_PAD + 4 * (rows_w * (1 << max_bits) + nt * kw * 32 + rows_w * nt)
    grid = (math.ceil(rows_out / rpc), max_active, splits)
    return GemmPlan("decode", nt, lpr, rpc, splits, split_cols, grid, shared)


def tiles_per_pass(per_expert: float, *wide: int) -> int:
    """The tiles regime's NT8: 8-token tiles per pass, room for TILES_HEADROOM x the mean
    tokens per expert, a power of two in [TILES_MIN_NT8, TILES_MAX_NT8], or the narrowest of the
    `wide` widths (a 3-4-bit layer's TILES_WIDE_NT8, the staged regime's STAGED_WIDE_NT8; 0: none)
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


def _wave_splits(ctas_per_split: int, words: int, most_splits: int, max_split: int) -> int:
    """The decode launch's column splits, from a model of its time: whole waves of
    GEMV_TARGET_CTAS (4 CTAs per SM) times the longest CTA (its warp steps plus a fixed cost).
    Small layers split until one wave is full, as before; a grid just over a whole number of
    waves takes fewer, longer splits instead of a tail wave (Mixtral's down at 1 token: 4
    splits, 512 CTAs, one wave, instead of 5 splits, 640 CTAs, 1.21 waves).
    Ties go to the smaller grid (fewer partials to reduce). Memoised: an eager layer call
    plans each projection (the search over splits cost ~17 us a Mixtral call on this CPU);
    the knobs it reads are part of the key, so a benchmark that changes them gets new plans."""
    return _wave_splits_for(ctas_per_split, words, most_splits, max_split, GEMV_TARGET_CTAS, GEMV_CTA_FIXED_STEPS)


@lru_cache(maxsize=4096)
def _wave_splits_for(ctas_per_split: int, words: int, most_splits: int, max_split: int,
                     wave: int, fixed_steps: int) -> int:
    def cost(splits):
        split_words = _split_words(words, splits, max_split)
        grid = ctas_per_split * math.ceil(words / split_words)
        return math.ceil(grid / wave) * (math.ceil(split_words / GEMV_STEP_WORDS) + fixed_steps), grid
    return min(range(1, most_splits + 1), key=cost)


def _lut_aware_split(stage: int, num_assign: int, lut_bits: int) -> int:
    """The most words a decode split may stage and still leave GEMV_LUT_AWARE_CTAS CTAs per SM
    room for their slot lists, (stage + 1) staged rows of split_words * 32 + 32 u16 (the .cu's
    tstride) and LUT rows of 2^lut_bits entries (gemv_extra_shared's)."""
    per_cta = GEMV_SM_SHARED // GEMV_LUT_AWARE_CTAS - 1024 - GEMV_STATIC_SHARED
    budget = per_cta - (num_assign * 4 + 15) // 16 * 16 - gemv_extra_shared(1, 1 << lut_bits)
    return (budget // ((stage + 1) * 2) - 32) // 32


def _gemv_plan(mode, num_tokens, top_k, cols, rows_out, max_active, nt8: int = 1, waves: bool = False,
               lut_bits: int = 0) -> GemmPlan:
    # Split the columns until the launch has about GEMV_TARGET_CTAS CTAs (small layers at 1
    # token would otherwise leave most SMs idle) and, at decode, a split's activations fit
    # their budget; the tiles regime stages one step at a time, so only the CTA count splits.
    rpc = GEMV_ROWS // 2 if mode == 0 else GEMV_ROWS
    tiles = math.ceil(rows_out / rpc)
    words = cols // 32
    stage = min(GEMV_TOKENS, num_tokens) if nt8 == 1 else GEMV_TOKENS * nt8
    max_split = GEMV_X_BYTES // ((stage + 1) * 64)
    if nt8 == 1 and GEMV_LUT_AWARE_CTAS and lut_bits:
        max_split = min(max_split, _lut_aware_split(stage, num_tokens * top_k, lut_bits))
    max_split = max(GEMV_STEP_WORDS, max_split // GEMV_STEP_WORDS * GEMV_STEP_WORDS)
    if nt8 > 1:
        max_split = math.ceil(words / GEMV_STEP_WORDS) * GEMV_STEP_WORDS
    most_splits = max(1, words // GEMV_MIN_SPLIT_WORDS)
    if waves:
        splits = _wave_splits(tiles * max_active, words, most_splits, max_split)
    else:
        target = GEMV_WIDE_TARGET_CTAS if nt8 == 1 else GEMV_TARGET_CTAS
        splits = min(math.ceil(target / (tiles * max_active)), most_splits)
    split_words = _split_words(words, splits, max_split)
    splits = math.ceil(words / split_words)
    num_assign = num_tokens * top_k
    staged_words = split_words if nt8 == 1 else GEMV_STEP_WORDS  # the .cu's tstride
    shared = (num_assign * 4 + 15) // 16 * 16 + (stage + 1) * (staged_words * 32 + 32) * 2
    return GemmPlan("gemv" if nt8 == 1 else "tiles", stage, 0, rpc, splits, split_words * 32,
                    (tiles, max_active, splits), shared, nt8)


def _prefill_plan(mode, mt, rows_out, max_bits, max_active, z) -> GemmPlan:
    rpc = PREFILL_ROWS // 2 if mode == 0 else PREFILL_ROWS
    shared = SMEM_ALIGN_PAD + 2 * (PREFILL_ROWS * (1 << max_bits) + (PREFILL_ROWS + mt) * PREFILL_SP)
    grid = (math.ceil(rows_out / rpc), max_active, z)
    return GemmPlan("prefill", mt, 0, rpc, 1, 0, grid, shared)


def staged_plan(mode: int, num_tokens: int, top_k: int, num_experts: int, rows_out: int, cls: int,
                lut_bits: int, max_active: int, aligned16: bool = True) -> GemmPlan:
    """One projection's launch in the staged regime (apl_staged.cu): passes of 8 * NT8 tokens as
    the tiles regime would choose them (tiles_per_pass; 96 tokens for 3-4-bit layers where it would
    take them and the planes are read as 16-byte vectors, aligned16: the 4-byte-load instances
    spill at 96; 128 tokens, STAGED_WIDE_NT8, where more than 96 are wanted there), grid (row
    tiles of 64 gate and 64 up rows or of 128 rows, active experts, groups of passes), and as many ring buffers, up to STAGED_STAGES, as leave 2 CTAs per SM room (else 1).
    lut_bits: the widest 5-8-bit block's bits (its LUT rows sit in shared memory), 0 for none."""
    per_expert = num_tokens * top_k / num_experts
    wide = (TILES_WIDE_NT8, STAGED_WIDE_NT8) if cls == 0 else (STAGED_LUT_WIDE_NT8,)
    nt8 = tiles_per_pass(per_expert, *(wide if aligned16 else ()))
    tokens = GEMV_TOKENS * nt8
    groups = max(1, min(math.ceil(num_tokens / tokens), math.ceil(per_expert / tokens)))
    rpc = STAGED_ROWS // 2 if mode == 0 else STAGED_ROWS
    lut = STAGED_ROWS * (1 << lut_bits) * 2 if lut_bits else 0
    planes = staged_plane_ring_bytes(cls, nt8, aligned16, lut_bits)
    stage = (STAGED_ROWS + tokens) * STAGED_STEP * 2  # the A tile, then the B tile
    least = staged_min_stages(cls, nt8, aligned16)
    for budget in STAGED_CTA_SHARED[-1:] if staged_blocks(cls) == 1 else STAGED_CTA_SHARED:  # (one CTA an SM: its budget)
        stages = min(max(STAGED_STAGES, least), STAGED_MAX_STAGES, (budget - staged_align_pad(cls) - lut - planes) // stage)
        if stages >= least:
            break
    else:
        raise APLKernelError(f"the staged regime needs {least} ring buffers of {stage} bytes beside {lut} bytes of LUT"
                             f" rows and {planes} of plane words")
    grid = (math.ceil(rows_out / rpc), max_active, groups)
    return GemmPlan("staged", tokens, 0, rpc, 1, 0, grid, staged_align_pad(cls) + lut + stages * stage + planes, nt8,
                    stages)


def staged_min_stages(cls: int, nt8: int, aligned16: bool) -> int:
    """The fewest ring buffers a staged launch can run with. 2: the consumers hand a buffer back after
    the next one's wgmma are issued, so one would deadlock. With NP producer warpgroups taking every
    NP-th unit of steps in turn, a warpgroup's next step can be U (NP - 1) + 1 steps on from its last
    (U: the steps of its widest rows' units), and its parity wait for that step's buffer is sound only
    if the ring holds as many (apl_staged.cu's mbar_wait_phase)."""
    unit = staged_low_unit(nt8, aligned16) if cls != 1 else 2
    return max(2, unit * (staged_producers(cls) - 1) + 1)


def staged_low_unit(nt8: int, aligned16: bool) -> int:
    """Steps a unit of a 3-4-bit row's plane words covers (the .cu's U): APL_STAGED_UNIT where the kernel
    takes it (16-byte plane loads, passes of up to 64 tokens), else 2 (5-8-bit rows: always 2)."""
    return KERNEL_DEFINES["APL_STAGED_UNIT"] if aligned16 and nt8 <= TILES_MAX_NT8 else 2


def staged_plane_ring_bytes(cls: int, nt8: int, aligned16: bool, lut_bits: int = 0) -> int:
    """The producers' plane ring past the ring buffers (APL_STAGED_PLANE_ASYNC: the 3-4-bit class;
    with APL_STAGED_PLANE_ASYNC_LUT the others too): per weight row, the largest of its widths' slots.
    3-4-bit rows: APL_STAGED_PREFETCH unit slots of 4 planes x 2 words a step, units of
    staged_low_unit steps. 5-8-bit rows (lut_bits planes, the launch's widest): APL_STAGED_PREFETCH_LUT
    slots (1 with 4-byte plane loads) of units of 2 steps. Per producer thread: staged_producers
    warpgroups of STAGED_ROWS threads."""
    if not KERNEL_DEFINES["APL_STAGED_PLANE_ASYNC"] or (cls != 0 and not KERNEL_DEFINES["APL_STAGED_PLANE_ASYNC_LUT"]):
        return 0
    low = KERNEL_DEFINES["APL_STAGED_PREFETCH"] * 4 * (2 * staged_low_unit(nt8, aligned16)) if cls != 1 else 0
    high = (KERNEL_DEFINES["APL_STAGED_PREFETCH_LUT"] if aligned16 else 1) * lut_bits * 4 if cls != 0 else 0
    return staged_producers(cls) * STAGED_ROWS * max(low, high) * 4


def staged_instances(flag: str, modes: tuple[int, ...] = (0, 1), bit_classes=None) -> list[str]:
    """Every apl_staged instance staged_projection can launch for activations of `flag` and these
    projections: per kernel class, plane alignment and pass width (staged_plan's: the tiles
    regime's above 1, 96 tokens with 16-byte plane loads only). bit_classes: the bit classes of
    the layers that take the regime (None: any, so the merged class 2 too)."""
    kernel_classes = (0, 1, 2) if bit_classes is None else \
        tuple(sorted(set(bit_classes) | ({2} if len(bit_classes) > 1 else set())))
    return [_staged_name(cls, mode, flag, v4, nt8) for mode in modes for cls in kernel_classes
            for v4 in ("true", "false") for nt8 in staged_choices(cls)
            if nt8 > 1 and (nt8 <= TILES_MAX_NT8 or v4 == "true")]


def staged_choices(cls: int) -> tuple[int, ...]:
    """Every NT8 staged_plan can pick for kernel class `cls`: the tiles regime's, and for the
    3-4-bit class the wider passes STAGED_WIDE_NT8 where it is set."""
    choices = tiles_choices(cls)
    wide = STAGED_WIDE_NT8 if cls == 0 else STAGED_LUT_WIDE_NT8
    if wide and wide not in choices:
        choices += (wide,)
    return choices


def staged_class(classes: dict[int, int]) -> tuple[int, int]:
    """(kernel class, lut_bits) of a staged launch over blocks of these bit classes (class ->
    widest bits): the merged class 2 where both are present; lut_bits the 5-8-bit class's widest."""
    cls = 2 if len(classes) > 1 else next(iter(classes))
    return cls, classes.get(1, 0)


def staged_layer(layer: "APLLayer", num_tokens: int, top_k: int) -> bool:
    """Whether the staged regime is the faster one for this layer's calls of num_tokens tokens:
    every block of both projections in STAGED_CLASSES, and STAGED_MIN_ASSIGNMENTS assignments or
    more for 3-4-bit layers, STAGED_LUT_MIN_PER_EXPERT an expert for layers with 5-8-bit blocks (below
    them the tiles regime was faster); any layer under STAGED_PREFILL."""
    if STAGED_PREFILL:
        return True
    classes = {cls for module in ("gate_up", "down") for cls in layer.classes[module]}
    least = STAGED_MIN_ASSIGNMENTS if classes <= {0} else STAGED_LUT_MIN_PER_EXPERT * layer.num_experts
    return classes <= STAGED_CLASSES and num_tokens * top_k >= least


def use_staged(plan: LaunchPlan, layer: "APLLayer", device: torch.device, legacy_decode: bool = False,
               num_tokens: int = 0, top_k: int = 0) -> bool:
    """Whether a layer call planned so runs the staged regime instead: the tiles and prefill
    regimes' calls (not the first kernels a legacy_decode call asks for) that staged_layer takes,
    outside stable launches, on a compute-capability 9.0 device."""
    return (plan.gate_up.regime in ("tiles", "prefill") and not legacy_decode and not layer.stable_launches
            and staged_layer(layer, num_tokens, top_k)
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


# ---------------------------------------------------------------- argument checks
def check_inputs(x, topk_ids, topk_weights, layer: APLLayer):
    """Everything the kernel assumes about its arguments; raises APLKernelError."""
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        raise APLKernelError(f"x must be [tokens, {layer.hidden}], got {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise APLKernelError(f"x must be bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise APLKernelError("x must be contiguous and 16-byte aligned (read as 16-byte vectors)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise APLKernelError(f"topk_ids must be [{x.shape[0]}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise APLKernelError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise APLKernelError(f"topk_weights must be floating point {tuple(topk_ids.shape)}, got "
                             f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if x.shape[0] * topk_ids.shape[1] >= 2 ** 31:
        raise APLKernelError("tokens * top_k must fit in int32")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device.type != "cuda":
            raise APLKernelError(f"{name} must be on a CUDA device, got {t.device}")
        if t.device != layer.device:
            raise APLKernelError(f"{name} is on {t.device}, the layer's blocks on {layer.device}")


# ---------------------------------------------------------------- CUDA launch (cupy)
def _defines(activation: str) -> tuple:
    return tuple(sorted({**KERNEL_DEFINES, "APL_ACT": ACT_CODES[activation]}.items()))


def _kernel(name: str, activation: str = "silu"):
    return _compiled(name, _defines(activation))


@dataclass
class CompileStats:
    """Kernel instances compiled in this process and the host seconds they took. A compile
    met inside a step stalls it (seconds at first use on the H200, docs/elasticity.md
    section 1): after `precompile` the count should not move."""

    count: int = 0
    seconds: float = 0.0


COMPILE_STATS = CompileStats()
_FUNCTIONS: dict[tuple[str, tuple], object] = {}  # (instance name, defines) -> loaded kernel
_COMPILE_LOCK = threading.Lock()


def _compiled(name: str, defines: tuple):
    """Compile (once per process) a module holding one kernel instance, e.g. 'apl_gemv<2, 0, true, true>'."""
    key = (name, defines)
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    import cupy as cp

    start = time.perf_counter()
    options = ("-std=c++17", *(f"-D{k}={v}" for k, v in defines))
    code = module_source(SOURCE, GEMV_SOURCE, STAGED_SOURCE)
    if wgmma_instance(name, dict(defines)):
        function = compile_for_arch(code, options, name, "sm_90a")
    else:
        module = cp.RawModule(code=code, options=options, name_expressions=[name])
        function = module.get_function(name)  # compiles (or reads cupy's disk cache) and loads
    with _COMPILE_LOCK:
        if key not in _FUNCTIONS:
            _FUNCTIONS[key] = function
            COMPILE_STATS.count += 1
            COMPILE_STATS.seconds += time.perf_counter() - start
        return _FUNCTIONS[key]


def instance_tiles(name: str) -> int:
    """The NT8 of an apl_gemv instance name, `apl_gemv<CLS, MODE, BF16, V2, NT8[, LONG]>` (or of
    its cluster pair or warp-specialised form, the same arguments; or of `apl_staged<CLS, MODE,
    BF16, V4, NT8>`)."""
    return int(name[name.index("<") + 1:].rstrip("> ").split(",")[4])


def wgmma_build(name: str, defines: dict[str, int]) -> bool:
    """True where `name` is a tiles-regime instance (apl_gemv with NT8 > 1, or its cluster pair
    apl_gemv_pair) whose wgmma path the defines turn on (APL_TILES_WGMMA with APL_TILES_ASYNC):
    on a Hopper GPU it is compiled for sm_90a (wgmma_instance; bench/sass_mix compiles it so for
    the H200 on any machine)."""
    return (bool(defines.get("APL_TILES_WGMMA")) and bool(defines.get("APL_TILES_ASYNC"))
            and name.startswith(("apl_gemv<", "apl_gemv_pair<", "apl_gemv_ws<")) and instance_tiles(name) > 1) \
        or name.startswith("apl_staged<")


def wgmma_instance(name: str, defines: dict[str, int]) -> bool:
    """wgmma_build on a compute-capability 9.0 device, which the instance is compiled for
    (sm_90a). Elsewhere the same source compiles to the mma.sync path."""
    return wgmma_build(name, defines) and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gemv_name(cls: int, mode: int, flag: str, aligned8: str, tiles: int = 1, long_split: bool = False) -> str:
    return f"apl_gemv<{cls}, {mode}, {flag}, {aligned8}, {tiles}{', true' if long_split else ''}>"


def long_split_classes() -> tuple[int, ...]:
    """The kernel classes compiled (and launched) with long-split decode instances: GEMV_LONG_SPLIT_CLASSES
    where APL_PLANE_HINT gives their loads a qualifier, none otherwise."""
    return tuple(GEMV_LONG_SPLIT_CLASSES) if KERNEL_DEFINES.get("APL_PLANE_HINT") else ()


def long_split(cls: int, plan: GemmPlan, cols: int) -> bool:
    """Whether a projection launch of this kernel class over rows of `cols` columns takes the
    long-split decode instance (long_split_classes and the lengths above)."""
    return (plan.tiles == 1 and cls in long_split_classes() and plan.tokens >= GEMV_LONG_MIN_TOKENS
            and plan.split_cols // 32 >= GEMV_LONG_SPLIT_WORDS and cols // 32 >= GEMV_LONG_ROW_WORDS)


def tiles_launch(name: str, grid: tuple[int, int, int], wgmma: bool) -> tuple[str, tuple[int, int, int]]:
    """The instance and grid a tiles launch takes on a wgmma build: with APL_TILES_PAIR the
    cluster pair (apl_gemv_pair: 2 CTAs of adjacent row tiles share the staging) over row tiles
    padded to even; else with APL_TILES_WS the warp-specialised kernel (apl_gemv_ws: a producer
    warp stages the activations) over the same grid; otherwise `name` and `grid` as they are."""
    if not (wgmma and instance_tiles(name) > 1):
        return name, grid
    if KERNEL_DEFINES.get("APL_TILES_PAIR"):
        return _pair_name(name), (grid[0] + grid[0] % 2, grid[1], grid[2])
    if KERNEL_DEFINES.get("APL_TILES_WS"):
        return _ws_name(name), grid
    return name, grid


def gemv_block(name: str) -> int:
    """Threads per CTA of an apl_gemv launch: 128, and 32 more per producer warp in apl_gemv_ws."""
    if name.startswith("apl_gemv_ws<"):
        return GEMV_THREADS + 32 * KERNEL_DEFINES.get("APL_TILES_WS_WARPS", 1)
    return GEMV_THREADS


def expert_major(cls: int, tiles: int) -> bool:
    """Whether a projection launch of this kernel class and NT8 numbers its CTAs expert-major
    (APL_GEMV_ORDER bit 1; apl_gemv.cu's gemv_entry, the cluster pair aside): its grid is then
    (row tiles, splits, active experts), so every row tile and split of one expert starts before
    the next expert's."""
    order = KERNEL_DEFINES.get("APL_GEMV_ORDER", 0)
    ordered = (cls == 2 or (cls == 1 and order & 8)) and (tiles == 1 or order & 4)
    return bool(ordered and order & 2)


def gemv_launch(cls: int, name: str, grid: tuple[int, int, int], wgmma: bool) -> tuple[str, tuple[int, int, int]]:
    """The instance and grid of one projection launch of apl_gemv instance `name` (kernel class
    cls) planned as (row tiles, active experts, splits): tiles_launch's, then the expert-major
    numbering where expert_major says."""
    name, grid = tiles_launch(name, grid, wgmma)
    if name.startswith(("apl_gemv<", "apl_gemv_ws<")) and expert_major(cls, instance_tiles(name)):
        return name, (grid[0], grid[2], grid[1])
    return name, grid


def _pair_name(name: str) -> str:
    """The cluster pair instance of an apl_gemv tiles instance (same template arguments)."""
    return name.replace("apl_gemv<", "apl_gemv_pair<", 1)


def _ws_name(name: str) -> str:
    """The warp-specialised instance of an apl_gemv tiles instance (same template arguments)."""
    return name.replace("apl_gemv<", "apl_gemv_ws<", 1)


def _fused_name(cls: int, flag: str, aligned8: str) -> str:
    return f"apl_gemv_fused<{cls}, {flag}, {aligned8}>"


FUSED_CLASSES = (0,)  # the fused launch is compiled for 3-4-bit layers only: with the 5-8-bit
# or merged bodies in one kernel, ptxas spilled 3.2-3.4 KB (nvcc 13.0, sm_90)


def tiles_choices(cls: int) -> tuple[int, ...]:
    """Every NT8 `plan_launch` can pick for launches of kernel class `cls`: 1 (decode), the tiles
    regime's powers of two, and for the 3-4-bit class TILES_WIDE_NT8 where it is set."""
    nt8, out = TILES_MIN_NT8, [1]
    while nt8 <= TILES_MAX_NT8:
        out.append(nt8)
        nt8 *= 2
    if cls == 0 and TILES_WIDE_NT8:
        out.append(TILES_WIDE_NT8)
    return tuple(out)


def _staged_name(cls: int, mode: int, flag: str, aligned16: str, tiles: int) -> str:
    return f"apl_staged<{cls}, {mode}, {flag}, {aligned16}, {tiles}>"


def _prefill_name(tile: int, mode: int, flag: str) -> str:
    return f"apl_prefill<{tile}, {mode}, {flag}>"


def _mode_activation(mode: int, activation: str) -> str:
    """The activation a projection's module is compiled with: gate_up applies the layer's;
    down applies none, and is compiled with the default define."""
    return activation if mode == 0 else "silu"


def kernel_instances(dtype: torch.dtype, activation: str = "silu") -> list[tuple[str, str]]:
    """(instance name, activation) of every kernel `apl_moe` can launch for activations of
    `dtype`, whatever the layer's bits, layout or token count: the decode kernel per bit class
    (3-4, 5-8, merged), projection, plane alignment and 8-token tiles per pass (and split length:
    long_split), the prefill kernel per token tile and
    projection, routing and combine, and with GEMV_FUSED the one-launch decode. The legacy decode
    kernel (a baseline) is left out."""
    if dtype not in ACT_DTYPES:
        raise APLKernelError(f"the fused kernel takes bfloat16 or float16 activations, got {dtype}")
    check_activation(activation)
    flag = _flag(dtype)
    names = [("moe_align", "silu"), (f"moe_combine<{flag}>", "silu")]
    tiles = sorted({tile for _, tile in PREFILL_TILES} | {PREFILL_LARGEST_TILE})
    for mode in (0, 1):
        act = _mode_activation(mode, activation)
        gemv = [_gemv_name(cls, mode, flag, v2, nt8)
                for cls in (0, 1, 2) for v2 in ("true", "false") for nt8 in tiles_choices(cls)]
        gemv += [_gemv_name(cls, mode, flag, v2, 1, True) for cls in long_split_classes() for v2 in ("true", "false")]
        names += [(name, act) for name in gemv]
        # APL_TILES_PAIR on a wgmma build: the tiles instances' cluster pairs too
        names += [(_pair_name(name), act) for name in gemv
                  if KERNEL_DEFINES.get("APL_TILES_PAIR") and wgmma_instance(name, KERNEL_DEFINES)]
        # APL_TILES_WS (and no pair) on a wgmma build: the warp-specialised tiles instances
        names += [(_ws_name(name), act) for name in gemv
                  if KERNEL_DEFINES.get("APL_TILES_WS") and not KERNEL_DEFINES.get("APL_TILES_PAIR")
                  and wgmma_instance(name, KERNEL_DEFINES)]
        names += [(_prefill_name(tile, mode, flag), act) for tile in tiles]
        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            names += [(name, act) for name in staged_instances(flag, (mode,), None if STAGED_PREFILL else STAGED_CLASSES)]
            if mode == 0 and staged_tma(0):
                names.append(("moe_gather_rows", "silu"))
    if GEMV_FUSED:  # (off by default: then no start-up time is spent compiling it)
        names += [(_fused_name(cls, flag, v2), activation) for cls in FUSED_CLASSES for v2 in ("true", "false")]
    return names


def precompile(dtype: torch.dtype, activation: str = "silu", device=None, max_workers: int | None = None) -> int:
    """Compile every kernel instance `apl_moe` can need for `dtype` (kernel_instances) now, so
    that no compile ever lands inside a step or a decode-graph capture when the pager changes
    a layer's bit classes. NVRTC runs outside the GIL, so the instances compile in threads.
    Returns the number compiled by this call (0 when all were already)."""
    todo = [(name, _defines(act)) for name, act in kernel_instances(dtype, activation)]
    todo = [key for key in todo if key not in _FUNCTIONS]
    if not todo:
        return 0
    import cupy as cp

    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index

    def compile_one(key):
        with cp.cuda.Device(index):  # the thread's current context: the module loads there
            _compiled(*key)

    workers = max_workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="apl-compile") as pool:
        list(pool.map(compile_one, todo))
    return len(todo)


def compile_stats() -> CompileStats:
    """A copy of the process's compile count and seconds (diff two to count a window's)."""
    with _COMPILE_LOCK:
        return CompileStats(COMPILE_STATS.count, COMPILE_STATS.seconds)


def _launch(name: str, grid, args, shared: int = 0, block: int = THREADS, activation: str = "silu",
            programmatic: bool = False):
    kernel = _kernel(name, activation)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    launch_on_torch_stream(kernel, grid, block, args, shared, programmatic)


def programmatic_down(cls: int, tiles: int) -> bool:
    """Whether a down launch of this kernel class and NT8 overlaps gate_up (under GEMV_PDL): the
    tiles regime and the 3-4-bit decode kernel. Measured slower for the 5-8-bit and merged decode
    kernels (Mixtral 1 token 8 bits 322.8 against 303.4 us, mixed 178.0 against 173.9;
    bench/results/apl_gemv_pdl_decode.json), whose waiting CTAs first fill their shared LUT rows
    (GEMV_PDL_DOWN_CLASSES adds classes, for the benchmark's variants)."""
    return tiles > 1 or cls in GEMV_PDL_DOWN_CLASSES


def programmatic_projections() -> tuple[bool, bool]:
    """(gate_up, down): which projection launches may overlap the kernel before them (GEMV_PDL,
    on a device of compute capability 9.0 or later, with the kernels' waits compiled in)."""
    if not GEMV_PDL or not KERNEL_DEFINES.get("APL_GEMV_PDL") or torch.cuda.get_device_capability() < (9, 0):
        return False, False
    return GEMV_PDL >= 2, True


def _flag(dtype) -> str:
    return "true" if dtype == torch.bfloat16 else "false"


def launch_gemm(mode: int, plan: GemmPlan, desc, active, num_active, sorted_slot, top_k: int,
                x, rows_out: int, cols: int, max_bits: int, h_out=None, y_out=None, num_slots: int = 0,
                activation: str = "silu"):
    """One projection for every active expert: mode 0 gate_up (+act(gate)*up -> h), 1 down (-> y)."""
    if plan.regime == "decode":
        name = f"apl_decode<{plan.tokens}, {plan.lanes_per_row}, {mode}, {_flag(x.dtype)}>"
        args = (desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, plan.split_cols,
                max_bits, h_out, y_out, num_slots)
    else:
        name = _prefill_name(plan.tokens, mode, _flag(x.dtype))
        args = (desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, max_bits, h_out, y_out)
    _launch(name, plan.grid, args, plan.shared_bytes, activation=_mode_activation(mode, activation))


_WEIGHT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def gemv_extra_shared(cls: int, lut_entries: int, tiles: int = 1) -> int:
    """Shared bytes a decode launch adds to its plan: the 5-8-bit LUT rows (512-byte aligned);
    for the 3-4-bit decode kernel with APL_GEMV_RING_STAGES >= 2, its cp.async ring of 4 warps
    (not compiled in the tiles regime); in the tiles regime with APL_TILES_ASYNC, the raw
    activation rows of one step and each token's row offset (8 * tiles tokens x (512 + 4)
    bytes, after the aligned LUT rows; rows of 528 bytes with APL_TILES_WGMMA). Decode launches
    also take GEMV_SHARED_PAD (0 in service: a tuning knob)."""
    extra = GEMV_ROWS * lut_entries * 2 + 512 if lut_entries else 0
    if tiles > 1 and KERNEL_DEFINES.get("APL_TILES_ASYNC", 0):
        raw_row = GEMV_STEP_WORDS * 64 + (16 if KERNEL_DEFINES.get("APL_TILES_WGMMA", 0) else 0)  # the .cu's RAW_ROW
        # APL_TILES_WS with 3 stages: the third B buffer, 16 slices of tiles x 256 bytes
        ws_third = tiles * 4096 if KERNEL_DEFINES.get("APL_TILES_WS") and KERNEL_DEFINES.get("APL_TILES_WS_STAGES") == 3 else 0
        return extra + 512 + GEMV_TOKENS * tiles * (raw_row + 4) + ws_third
    stages = KERNEL_DEFINES.get("APL_GEMV_RING_STAGES", 0)
    if cls == 0 and stages >= 2 and tiles == 1:
        extra = 512 + (GEMV_THREADS // 32) * stages * GEMV_RING_STAGE_BYTES
    return extra + GEMV_SHARED_PAD


def _class_launches(classes: dict[int, int]) -> list[tuple[int, int]]:
    """(kernel class, widest bits for its shared LUT) per launch: one per class present, or
    the merged kernel (class 2) once when GEMV_MERGE_CLASSES and both are present."""
    if GEMV_MERGE_CLASSES and len(classes) > 1:
        return [(2, classes[1])]
    return list(classes.items())


def fused_class(launches: dict[str, list[tuple[int, int]]], tiles: int) -> int | None:
    """The kernel class of the one-launch decode for a layer whose projections launch these
    (class, widest bits) lists, or None for two launches: decode only (NT8 1), GEMV_FUSED
    on, one launch per projection of the same class, a class FUSED_CLASSES holds."""
    gu, dn = launches["gate_up"], launches["down"]
    if not GEMV_FUSED or tiles != 1 or len(gu) != 1 or len(dn) != 1 or gu[0][0] != dn[0][0]:
        return None
    return gu[0][0] if gu[0][0] in FUSED_CLASSES else None


def fused_ctas(plan: LaunchPlan) -> int:
    """CTAs of the fused decode launch: the gate_up grid's, then the down grid's."""
    return math.prod(plan.gate_up.grid) + math.prod(plan.down.grid)


def _apl_moe_gemv(x, ids, topk_weights, layer: APLLayer, plan: LaunchPlan, out: torch.Tensor):
    """Decode and the tiles regime: per bit class present, one gate_up and one down launch; the
    kernels route, reduce their column splits and combine the top-k outputs themselves."""
    T, H = x.shape
    k, E, I = ids.shape[1], layer.num_experts, layer.intermediate
    num_assign = T * k
    w_kind = _WEIGHT_KINDS.get(topk_weights.dtype)
    weights = topk_weights.contiguous() if w_kind is not None else topk_weights.to(torch.float32).contiguous()
    w_kind = w_kind or 0
    flag = _flag(x.dtype)
    gu, dn = plan.gate_up, plan.down
    part_gu = torch.empty(gu.splits * num_assign * 2 * I, dtype=torch.float32, device=x.device)
    part_dn = torch.empty(dn.splits * num_assign * H, dtype=torch.float32, device=x.device)
    h = torch.empty(num_assign, I, dtype=x.dtype, device=x.device)
    v2 = {m: "true" if layer.aligned8[m] else "false" for m in ("gate_up", "down")}
    launches = {m: layer.decode_launches(m) for m in ("gate_up", "down")}
    fused = fused_class(launches, gu.tiles)
    if fused is not None:
        aligned = "true" if layer.aligned8["gate_up"] and layer.aligned8["down"] else "false"
        shared = max(gu.shared_bytes, dn.shared_bytes) + gemv_extra_shared(fused, 0)
        _launch(_fused_name(fused, flag, aligned), (fused_ctas(plan),),
                (layer.gate_up_desc, layer.down_desc, ids, num_assign, k, E, gu.grid[1], x, I, H, gu.split_cols // 32,
                 gu.splits, 0, dn.split_cols // 32, dn.splits, 0, gu.tokens, part_gu, part_dn, layer.counters, h,
                 weights, w_kind, T, out),
                shared, block=GEMV_THREADS, activation=layer.activation)
        return out
    wgmma = gu.tiles > 1 and wgmma_instance(_gemv_name(0, 0, flag, v2["gate_up"], gu.tiles), KERNEL_DEFINES)
    pdl_gate_up, pdl_down = programmatic_projections()
    for cls, widest in launches["gate_up"]:
        lut = 1 << widest if cls >= 1 else 0
        name, grid = gemv_launch(cls, _gemv_name(cls, 0, flag, v2["gate_up"], gu.tiles, long_split(cls, gu, H)), gu.grid, wgmma)
        _launch(name, grid,
                (layer.gate_up_desc, ids, num_assign, k, E, x, I, H, gu.split_cols // 32, lut, gu.tokens,
                 part_gu, layer.counters, h, weights, w_kind, T, out, 0),
                gu.shared_bytes + gemv_extra_shared(cls, lut, gu.tiles), block=gemv_block(name),
                activation=layer.activation, programmatic=pdl_gate_up)
    for i, (cls, widest) in enumerate(launches["down"]):
        lut = 1 << widest if cls >= 1 else 0
        name, grid = gemv_launch(cls, _gemv_name(cls, 1, flag, v2["down"], dn.tiles, long_split(cls, dn, I)), dn.grid, wgmma)
        _launch(name, grid,
                (layer.down_desc, ids, num_assign, k, E, h, H, I, dn.split_cols // 32, lut, dn.tokens,
                 part_dn, layer.counters, None, weights, w_kind, T, out, int(i == 0)),
                dn.shared_bytes + gemv_extra_shared(cls, lut, dn.tiles), block=gemv_block(name),
                programmatic=pdl_down and programmatic_down(cls, dn.tiles))
    return out


def apl_moe(x, topk_ids, topk_weights, layer: APLLayer, out: torch.Tensor | None = None,
            legacy_decode: bool = False) -> torch.Tensor:
    """The MoE layer's routed-expert output [T, H] in x's dtype, from planes and LUTs.
    legacy_decode: run few-token calls through the first decode kernel (a baseline)."""
    check_inputs(x, topk_ids, topk_weights, layer)
    T, H = x.shape
    k, E, I = topk_ids.shape[1], layer.num_experts, layer.intermediate
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise APLKernelError(f"out must be contiguous {x.dtype} {tuple(x.shape)} on {x.device}")
    if T == 0:
        return out
    max_bits = layer.max_bits
    plan = plan_launch(T, k, E, H, I, max_bits, legacy_decode, layer.stable_launches)
    device = x.device
    with torch.cuda.device(device):
        ids = topk_ids.to(torch.int64).contiguous()
        if use_staged(plan, layer, device, legacy_decode, T, k):
            return _four_launches(x, ids, topk_weights, layer, plan.max_active, out,
                                  staged_projection(layer, T, k, plan.max_active, _flag(x.dtype)))
        if plan.gate_up.regime in ("gemv", "tiles"):
            return _apl_moe_gemv(x, ids, topk_weights, layer, plan, out)

        def projection(mode, desc, active, num_active, sorted_slot, src, rows_out, cols, h_out, y_out):
            launch_gemm(mode, plan.gate_up if mode == 0 else plan.down, desc, active, num_active, sorted_slot, k,
                        src, rows_out, cols, max_bits, h_out=h_out, y_out=y_out, num_slots=T * k,
                        activation=layer.activation)
        return _four_launches(x, ids, topk_weights, layer, plan.max_active, out, projection, plan.down.splits)


def _four_launches(x, ids, topk_weights, layer: APLLayer, max_active: int, out: torch.Tensor, projection,
                   splits: int = 1):
    """moe_align, the two projections (`projection(mode, desc, active, num_active, sorted_slot,
    src, rows_out, cols, h_out, y_out)` launches one), then moe_combine: the prefill, first decode
    and staged regimes. Down writes `splits` fp32 rows per assignment (its column splits)."""
    T, H = x.shape
    k, E, I = ids.shape[1], layer.num_experts, layer.intermediate
    num_slots = T * k
    device = x.device
    weights = topk_weights.to(torch.float32).contiguous()
    sorted_slot = torch.empty(num_slots, dtype=torch.int32, device=device)
    active = torch.empty(max_active * 3, dtype=torch.int32, device=device)
    num_active = torch.empty(1, dtype=torch.int32, device=device)
    h = torch.empty(num_slots, I, dtype=x.dtype, device=device)
    y = torch.empty(splits, num_slots, H, dtype=torch.float32, device=device)
    _launch("moe_align", (1,), (ids, num_slots, E, sorted_slot, active, num_active), block=1024)
    projection(0, layer.gate_up_desc, active, num_active, sorted_slot, x, I, H, h, None)
    projection(1, layer.down_desc, active, num_active, sorted_slot, h, H, I, None, y)
    _launch(f"moe_combine<{_flag(x.dtype)}>", (math.ceil(T * H / THREADS),),
            (y, splits, num_slots, ids, weights, E, T, k, H, out))
    return out


def staged_projection(layer: APLLayer, num_tokens: int, top_k: int, max_active: int, flag: str):
    """_four_launches' projection for the staged regime: per projection the kernel class of its
    blocks (staged_class) and their 16-byte alignment pick the instance, staged_plan the launch."""
    def projection(mode, desc, active, num_active, sorted_slot, src, rows_out, cols, h_out, y_out):
        module = "gate_up" if mode == 0 else "down"
        cls, lut_bits = staged_class(layer.classes[module])
        aligned16 = layer.aligned16[module]
        plan = staged_plan(mode, num_tokens, top_k, layer.num_experts, rows_out, cls, lut_bits, max_active, aligned16)
        name = _staged_name(cls, mode, flag, "true" if aligned16 else "false", plan.tiles)
        act_map = staged_activation_map(mode, src, sorted_slot, top_k, plan.tokens, cls)
        _launch(name, plan.grid, (desc, active, num_active, sorted_slot, top_k, src, rows_out, cols, lut_bits,
                                  h_out, y_out, plan.stages, act_map),
                plan.shared_bytes, block=staged_threads(cls), activation=_mode_activation(mode, layer.activation))
    return projection


def staged_activation_map(mode: int, src: torch.Tensor, sorted_slot: torch.Tensor, top_k: int, tokens: int,
                          cls: int):
    """The staged launch's tensor map over its activations by sorted position (staged_tma(cls)):
    boxes of a pass's `tokens` rows by one 64-column step. Down's h is in that order already;
    gate_up's x is gathered into it first (moe_gather_rows, [tokens * top_k, hidden]: 4 MB at
    Mixtral size and 256 tokens). Without TMA the kernel reads no map: zeros."""
    from pagedweight_kernels.tensor_maps import EMPTY_MAP, row_box_map

    if not staged_tma(cls):
        return EMPTY_MAP
    rows = src
    if mode == 0:
        num_slots, cols = sorted_slot.numel(), src.shape[1]
        rows = torch.empty(num_slots, cols, dtype=src.dtype, device=src.device)
        chunks = cols * src.element_size() // 16
        _launch("moe_gather_rows", (math.ceil(num_slots * chunks / THREADS),),
                (src, sorted_slot, top_k, num_slots, chunks, rows))
    return row_box_map(rows, tokens, STAGED_STEP)


def kernel_available() -> bool:
    """True where the fused kernel can run: a CUDA device and cupy."""
    return cuda_with("cupy")


__all__ = [
    "APLKernelError", "APLLayer", "ResidentBlock", "apl_moe", "apl_moe_reference", "check_inputs",
    "bit_class", "compile_stats", "fused_class", "fused_counter_words", "kernel_available", "kernel_instances", "lanes_per_row", "launch_gemm", "long_split",
    "long_split_classes",
    "plan_launch", "precompile", "tiles_per_pass", "MIN_BITS", "MAX_BITS",
]
