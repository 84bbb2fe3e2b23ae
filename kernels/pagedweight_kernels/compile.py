"""The fused operator's CUDA sources, instance names and compile cache.

One module text (apl_moe.cu, apl_gemv.cu, apl_staged.cu, after the dtype conversions) is compiled
once per (instance, defines): cupy's NVRTC for the plain architecture, `compile_for_arch` for
sm_90a where the instance uses wgmma (apl_gemv's tiles instances and apl_staged). `precompile`
compiles every instance a dtype can need up front, so none lands inside a step.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedweight_kernels.config import DEFAULT_CONFIG, KernelConfig
from pagedweight_kernels.cuda_packages import compile_for_arch, module_source
from pagedweight_kernels.layer import APLKernelError
from pagedweight_kernels.moe_reference import check_activation
from pagedweight_kernels.plan import PREFILL_LARGEST_TILE, PREFILL_TILES, TILES_MAX_NT8, staged_choices, tiles_choices

SOURCE = Path(__file__).with_name("apl_moe.cu")
GEMV_SOURCE = Path(__file__).with_name("apl_gemv.cu")  # compiled after SOURCE (uses its helpers)
PREFILL_SOURCE = Path(__file__).with_name("apl_prefill.cu")  # compiled after both (uses their row tables)
STAGED_SOURCE = Path(__file__).with_name("apl_staged.cu")  # compiled after them (uses their helpers)
ACT_DTYPES = (torch.bfloat16, torch.float16)


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


def kernel(name: str, activation: str = "silu", config: KernelConfig = DEFAULT_CONFIG):
    """The loaded kernel instance `name` compiled with the config's defines and the activation."""
    return compiled(name, config.defines(activation))


def compiled(name: str, defines: tuple):
    """Compile (once per process) a module holding one kernel instance, e.g. 'apl_gemv<2, 0, true, true, 1>'."""
    key = (name, defines)
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    import cupy as cp

    start = time.perf_counter()
    options = ("-std=c++17", *(f"-D{k}={v}" for k, v in defines))
    code = module_source(SOURCE, GEMV_SOURCE, PREFILL_SOURCE, STAGED_SOURCE)
    if wgmma_instance(name):
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


def compile_stats() -> CompileStats:
    """A copy of the process's compile count and seconds (diff two to count a window's)."""
    with _COMPILE_LOCK:
        return CompileStats(COMPILE_STATS.count, COMPILE_STATS.seconds)


# ---------------------------------------------------------------- instance names
def flag(dtype) -> str:
    return "true" if dtype == torch.bfloat16 else "false"


def gemv_name(cls: int, mode: int, flag: str, aligned8: str, tiles: int = 1, long_split: bool = False) -> str:
    return f"apl_gemv<{cls}, {mode}, {flag}, {aligned8}, {tiles}{', true' if long_split else ''}>"


def staged_name(cls: int, mode: int, flag: str, aligned16: str, tiles: int) -> str:
    return f"apl_staged<{cls}, {mode}, {flag}, {aligned16}, {tiles}>"


def prefill_name(tile: int, mode: int, flag: str) -> str:
    return f"apl_prefill<{tile}, {mode}, {flag}>"


def mode_activation(mode: int, activation: str) -> str:
    """The activation a projection's module is compiled with: gate_up applies the layer's;
    down applies none, and is compiled with the default define."""
    return activation if mode == 0 else "silu"


def instance_tiles(name: str) -> int:
    """The NT8 of `apl_gemv<CLS, MODE, BF16, V2, NT8[, LONG]>` or `apl_staged<CLS, MODE, BF16, V4, NT8>`."""
    return int(name[name.index("<") + 1:].rstrip("> ").split(",")[4])


def wgmma_build(name: str) -> bool:
    """True where `name` is a tiles-regime apl_gemv instance (NT8 > 1) or an apl_staged instance:
    on a Hopper GPU it is compiled for sm_90a (wgmma_instance; bench/sass_mix compiles it so on any
    machine). Elsewhere the apl_gemv source compiles to its mma.sync path."""
    return (name.startswith("apl_gemv<") and instance_tiles(name) > 1) or name.startswith("apl_staged<")


def wgmma_instance(name: str) -> bool:
    """wgmma_build on a compute-capability 9.0 device, which the instance is compiled for (sm_90a)."""
    return wgmma_build(name) and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def staged_instances(flag: str, modes: tuple[int, ...] = (0, 1), bit_classes=None,
                     config: KernelConfig = DEFAULT_CONFIG) -> list[str]:
    """Every apl_staged instance the staged regime can launch for activations of `flag` and these
    projections: per kernel class, plane alignment and pass width (staged_plan's: the tiles
    regime's above 1, the wide passes with 16-byte plane loads only). bit_classes: the bit classes
    of the layers that take the regime (None: any, so the merged class 2 too)."""
    kernel_classes = (0, 1, 2) if bit_classes is None else \
        tuple(sorted(set(bit_classes) | ({2} if len(bit_classes) > 1 else set())))
    return [staged_name(cls, mode, flag, v4, nt8) for mode in modes for cls in kernel_classes
            for v4 in ("true", "false") for nt8 in staged_choices(cls, config)
            if nt8 > 1 and (nt8 <= TILES_MAX_NT8 or v4 == "true")]


def kernel_instances(dtype: torch.dtype, activation: str = "silu",
                     config: KernelConfig = DEFAULT_CONFIG) -> list[tuple[str, str]]:
    """(instance name, activation) of every kernel `apl_moe` can launch for activations of
    `dtype`, whatever the layer's bits, layout or token count: the decode kernel per bit class
    (3-4, 5-8, merged), projection, plane alignment and 8-token tiles per pass (and the
    long-split decode instances), the prefill kernel per token tile and projection, routing and
    combine, and on a compute-capability 9.0 device the staged regime's."""
    if dtype not in ACT_DTYPES:
        raise APLKernelError(f"the fused kernel takes bfloat16 or float16 activations, got {dtype}")
    check_activation(activation)
    f = flag(dtype)
    names = [("moe_align", "silu"), (f"moe_combine<{f}>", "silu")]
    tiles = sorted({tile for _, tile in PREFILL_TILES} | {PREFILL_LARGEST_TILE})
    for mode in (0, 1):
        act = mode_activation(mode, activation)
        gemv = [gemv_name(cls, mode, f, v2, nt8)
                for cls in (0, 1, 2) for v2 in ("true", "false") for nt8 in tiles_choices(cls, config)]
        gemv += [gemv_name(cls, mode, f, v2, 1, True) for cls in (0, 1, 2) for v2 in ("true", "false")]
        names += [(name, act) for name in gemv]
        names += [(prefill_name(tile, mode, f), act) for tile in tiles]
        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            classes = None if config.staged_every_layer else config.staged_classes
            names += [(name, act) for name in staged_instances(f, (mode,), classes, config)]
            if mode == 0:  # (gate_up's activations gathered for the staged launches' TMA)
                names.append(("moe_gather_rows", "silu"))
    return names


def precompile(dtype: torch.dtype, activation: str = "silu", device=None, max_workers: int | None = None,
               config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Compile every kernel instance `apl_moe` can need for `dtype` (kernel_instances) now, so
    that no compile ever lands inside a step or a decode-graph capture when the pager changes
    a layer's bit classes. NVRTC runs outside the GIL, so the instances compile in threads.
    Returns the number compiled by this call (0 when all were already)."""
    todo = [(name, config.defines(act)) for name, act in kernel_instances(dtype, activation, config)]
    todo = [key for key in todo if key not in _FUNCTIONS]
    if not todo:
        return 0
    import cupy as cp

    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index

    def compile_one(key):
        with cp.cuda.Device(index):  # the thread's current context: the module loads there
            compiled(*key)

    workers = max_workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="apl-compile") as pool:
        list(pool.map(compile_one, todo))
    return len(todo)
