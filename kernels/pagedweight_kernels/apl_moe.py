"""The fused APL MoE operator: launcher for kernels/pagedweight_kernels/apl_moe.cu and its plain torch reference.

`apl_moe(x, topk_ids, topk_weights, layer)` computes one MoE layer's routed experts
straight from bit-planes and LUTs, every block at its own bit-width, in four launches on
PyTorch's current stream with no host synchronisation (see the .cu file's header).
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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedweight_kernels.moe_reference import moe_forward
from pagedweight.format.apl_format import (
    COL_ALIGN, LUT_DTYPE, MAX_BITS, MIN_BITS, APLBlock, check_bits, dequantize,
)

SOURCE = Path(__file__).with_name("apl_moe.cu")
DESC_WIDTH = 10  # int64 per block: bits, LUT address, 8 plane addresses (kept in step with the .cu)
DESC_BITS, DESC_LUT, DESC_PLANES = 0, 1, 2
MAX_EXPERTS = 1024  # moe_align's shared counters
ACT_DTYPES = (torch.bfloat16, torch.float16)

# Regime choice (per launch, from the host-known average tokens per expert, T*k/E).
DECODE_MAX_TOKENS_PER_EXPERT = 2.0  # above: tensor-core prefill kernel
PREFILL_TILES = ((12.0, 16), (40.0, 32), (80.0, 64))  # (up to this many tokens per expert, tile); else 128
DECODE_X_BYTES = 32 * 1024  # shared-memory budget for one column split's activations
SMEM_ALIGN_PAD = 1024  # kernels round their shared memory start up to 1 KB (aligned LUT rows)
PREFILL_ROWS, PREFILL_SP = 64, 136  # weight rows per prefill CTA; padded shared row (u16)
THREADS = 256
# Compile-time knobs of the .cu (see its header); the host plans with the same values.
KERNEL_DEFINES = {"APL_LDS_MODE": 1, "APL_RPG_DIV": 8, "APL_PREFETCH": 1, "APL_DECODE_MIN_BLOCKS": 2,
                  "APL_SHIFT_MODE": 0, "APL_PREFILL_MIN_BLOCKS": 1}


class APLKernelError(ValueError):
    """Arguments the fused kernel cannot take (dtype, shape, device, layout)."""


# ---------------------------------------------------------------- the layer description
@dataclass
class ResidentBlock:
    """What the GPU holds of one block at its committed bit-width."""

    bits: int
    planes: list[torch.Tensor]  # planes 0..bits-1, each uint8 [rows, cols/8], contiguous, anywhere
    lut: torch.Tensor  # LUT_bits, fp16 [rows, 2^bits], contiguous

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
        if self.lut.dtype != LUT_DTYPE or tuple(self.lut.shape) != (rows, 1 << self.bits) \
                or not self.lut.is_contiguous():
            raise APLKernelError(f"LUT_{self.bits} must be contiguous {LUT_DTYPE} [{rows}, {1 << self.bits}], "
                                 f"got {self.lut.dtype} {tuple(self.lut.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes[0].shape[0], self.planes[0].shape[1] * 8

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
    """The planes 0..bits-1 and LUT_bits of a block, copied to `device`."""
    planes = [block.planes[p].to(device).contiguous() for p in range(bits)]
    return ResidentBlock(bits, planes, block.luts[bits].to(device).contiguous())


@dataclass
class APLLayer:
    """All routed expert blocks of one MoE layer, as the fused kernel reads them."""

    gate_up: list[ResidentBlock]  # per expert, [2I, H] (gate rows, then up rows)
    down: list[ResidentBlock]  # per expert, [H, I]
    num_experts: int = field(init=False)
    hidden: int = field(init=False)
    intermediate: int = field(init=False)
    gate_up_desc: torch.Tensor = field(init=False)  # int64 [E, DESC_WIDTH] on the blocks' device
    down_desc: torch.Tensor = field(init=False)
    max_bits: int = field(init=False)  # largest committed bit-width: sizes the kernels' shared LUTs

    def __post_init__(self):
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
        self._check_block(expert, module, block)
        getattr(self, module)[expert] = block
        desc = self.gate_up_desc if module == "gate_up" else self.down_desc
        desc[expert].copy_(torch.tensor(block.descriptor(), dtype=torch.int64))
        self.max_bits = max(b.bits for b in self.gate_up + self.down)

    def refresh(self):
        """Rebuild both descriptor tensors from the blocks (host -> device copy)."""
        self.gate_up_desc = _descriptors(self.gate_up, self.device)
        self.down_desc = _descriptors(self.down, self.device)
        self.max_bits = max(b.bits for b in self.gate_up + self.down)

    def nbytes_active(self, expert_ids) -> int:
        """Plane + LUT bytes the kernel reads for these experts at their committed bits."""
        total = 0
        for e in expert_ids:
            for block in (self.gate_up[e], self.down[e]):
                rows, cols = block.shape
                total += rows * cols * block.bits // 8 + rows * (1 << block.bits) * 2
        return total


def _descriptors(blocks: list[ResidentBlock], device) -> torch.Tensor:
    return torch.tensor([b.descriptor() for b in blocks], dtype=torch.int64).to(device)


# ---------------------------------------------------------------- the torch reference
def apl_moe_reference(x, topk_ids, topk_weights, layer: APLLayer) -> torch.Tensor:
    """Plain torch: dequantise each used block, round to x's dtype, reference combine."""

    def expert(e: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up[e].dequantize().to(tokens.device, tokens.dtype)
        gate, up = F.linear(tokens, gate_up).chunk(2, dim=-1)
        down = layer.down[e].dequantize().to(tokens.device, tokens.dtype)
        return F.linear(F.silu(gate) * up, down)

    return moe_forward(x, topk_ids, topk_weights, expert, layer.num_experts)


# ---------------------------------------------------------------- launch planning (host only)
@dataclass(frozen=True)
class GemmPlan:
    """How one projection (gate_up or down) is launched."""

    regime: str  # "decode" (GEMV, CUDA cores) or "prefill" (dequantised tiles, tensor cores)
    tokens: int  # decode: tokens per pass (NT); prefill: token tile (MT)
    lanes_per_row: int  # decode: lanes sharing one weight row
    rows_per_cta: int  # output rows per CTA (gate_up: h columns)
    splits: int  # column splits (decode down only)
    split_cols: int
    grid: tuple[int, int, int]
    shared_bytes: int


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
                max_bits: int) -> LaunchPlan:
    """Pick the regime and the grids from host-known sizes only (no look at the routing)."""
    per_expert = num_tokens * top_k / num_experts
    max_active = min(num_experts, num_tokens * top_k)
    if per_expert <= DECODE_MAX_TOKENS_PER_EXPERT:
        nt = 1 if num_tokens == 1 else 2  # activations live in registers: a second token is nearly free
        gate_up = _decode_plan(0, nt, hidden, intermediate, max_bits, max_active)
        down = _decode_plan(1, nt, intermediate, hidden, max_bits, max_active)
    else:
        mt = next((tile for limit, tile in PREFILL_TILES if per_expert <= limit), 128)
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


def _prefill_plan(mode, mt, rows_out, max_bits, max_active, z) -> GemmPlan:
    rpc = PREFILL_ROWS // 2 if mode == 0 else PREFILL_ROWS
    shared = SMEM_ALIGN_PAD + 2 * (PREFILL_ROWS * (1 << max_bits) + (PREFILL_ROWS + mt) * PREFILL_SP)
    grid = (math.ceil(rows_out / rpc), max_active, z)
    return GemmPlan("prefill", mt, 0, rpc, 1, 0, grid, shared)


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
def _kernel(name: str):
    return _compiled(name, tuple(sorted(KERNEL_DEFINES.items())))


@lru_cache(maxsize=None)
def _compiled(name: str, defines: tuple):
    """Compile (once per process) a module holding one kernel instance, e.g. 'apl_decode<1, 32, 0, true>'."""
    import cupy as cp

    options = ("-std=c++17", *(f"-D{k}={v}" for k, v in defines))
    module = cp.RawModule(code=SOURCE.read_text(), options=options, name_expressions=[name])
    return module.get_function(name)


def _launch(name: str, grid, args, shared: int = 0, block: int = THREADS):
    import cupy as cp
    import numpy as np

    kernel = _kernel(name)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    packed = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else
                   (np.uint64(0) if a is None else np.int32(a)) for a in args)
    with _cupy_stream(torch.cuda.current_stream().cuda_stream):  # PyTorch's current stream
        kernel(grid, (block,), packed, shared_mem=shared)


@lru_cache(maxsize=64)
def _cupy_stream(handle: int):
    import warnings

    import cupy as cp

    with warnings.catch_warnings():  # cupy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(handle)


def _flag(dtype) -> str:
    return "true" if dtype == torch.bfloat16 else "false"


def launch_gemm(mode: int, plan: GemmPlan, desc, active, num_active, sorted_slot, top_k: int,
                x, rows_out: int, cols: int, max_bits: int, h_out=None, y_out=None, num_slots: int = 0):
    """One projection for every active expert: mode 0 gate_up (+SiLU*up -> h), 1 down (-> y)."""
    if plan.regime == "decode":
        name = f"apl_decode<{plan.tokens}, {plan.lanes_per_row}, {mode}, {_flag(x.dtype)}>"
        args = (desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, plan.split_cols,
                max_bits, h_out, y_out, num_slots)
    else:
        name = f"apl_prefill<{plan.tokens}, {mode}, {_flag(x.dtype)}>"
        args = (desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, max_bits, h_out, y_out)
    _launch(name, plan.grid, args, plan.shared_bytes)


def apl_moe(x, topk_ids, topk_weights, layer: APLLayer, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer's routed-expert output [T, H] in x's dtype, from planes and LUTs."""
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
    plan = plan_launch(T, k, E, H, I, max_bits)
    num_slots = T * k
    device = x.device
    with torch.cuda.device(device):
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        sorted_slot = torch.empty(num_slots, dtype=torch.int32, device=device)
        active = torch.empty(plan.max_active * 3, dtype=torch.int32, device=device)
        num_active = torch.empty(1, dtype=torch.int32, device=device)
        h = torch.empty(num_slots, I, dtype=x.dtype, device=device)
        y = torch.empty(plan.down.splits, num_slots, H, dtype=torch.float32, device=device)
        _launch("moe_align", (1,), (ids, num_slots, E, sorted_slot, active, num_active), block=1024)
        launch_gemm(0, plan.gate_up, layer.gate_up_desc, active, num_active, sorted_slot, k,
                    x, I, H, max_bits, h_out=h)
        launch_gemm(1, plan.down, layer.down_desc, active, num_active, sorted_slot, k,
                    h, H, I, max_bits, y_out=y, num_slots=num_slots)
        _launch(f"moe_combine<{_flag(x.dtype)}>", (math.ceil(T * H / THREADS),),
                (y, plan.down.splits, num_slots, ids, weights, E, T, k, H, out))
    return out


def kernel_available() -> bool:
    """True where the fused kernel can run: a CUDA device and cupy."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "APLKernelError", "APLLayer", "ResidentBlock", "apl_moe", "apl_moe_reference", "check_inputs",
    "kernel_available", "lanes_per_row", "launch_gemm", "plan_launch", "MIN_BITS", "MAX_BITS",
]
