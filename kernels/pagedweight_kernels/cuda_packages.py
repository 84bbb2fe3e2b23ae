"""Where a kernel can run (a CUDA device and the package that builds it: cupy, triton), the
CUDA text a cupy module compiles, a compile for an architecture cupy does not target (sm_90a),
and how its kernels launch on PyTorch's stream."""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import torch


def cuda_with(package: str) -> bool:
    """True where a CUDA device is visible and `package` imports (an installed package
    that fails to load, e.g. without its CUDA libraries, counts as absent)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


CONVERSIONS_SOURCE = Path(__file__).with_name("dtype_conversions.cu")


def module_source(*sources: Path) -> str:
    """One cupy module's CUDA text: the shared dtype conversions, then `sources` in order
    (NVRTC through cupy compiles a single string; the package ships no headers)."""
    return "\n".join(path.read_text() for path in (CONVERSIONS_SOURCE, *sources))


def compile_for_arch(code: str, options: tuple[str, ...], name: str, arch: str):
    """The cupy kernel `name` (a template instance's name expression) of `code`, compiled by
    NVRTC for `arch` (e.g. "sm_90a": cupy's RawModule targets the device's plain sm_XX, which
    has no wgmma). Cubins are kept in a disk cache (PAGEDWEIGHT_KERNEL_CACHE, default
    ~/.cache/pagedweight/kernels) keyed by the text, options, name, arch and NVRTC version, so a
    process pays each compile once per machine, as with cupy's own cache."""
    from cupy.cuda import function, nvrtc

    version = nvrtc.getVersion()
    key = hashlib.sha256("\0".join([code, *options, name, arch, repr(version)]).encode()).hexdigest()
    cache = Path(os.environ.get("PAGEDWEIGHT_KERNEL_CACHE", Path.home() / ".cache" / "pagedweight" / "kernels"))
    entry = cache / f"{key}.cubin"
    lowered_path = cache / f"{key}.name"
    if entry.exists() and lowered_path.exists():
        cubin, lowered = entry.read_bytes(), lowered_path.read_text()
    else:
        program = nvrtc.createProgram(code, "kernel.cu", [], [])
        try:
            nvrtc.addNameExpression(program, name)
            try:
                nvrtc.compileProgram(program, [*options, f"--gpu-architecture={arch}",
                                               "--device-as-default-execution-space"])
            except nvrtc.NVRTCError as exc:
                raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{nvrtc.getProgramLog(program)}") from exc
            lowered = nvrtc.getLoweredName(program, name)
            cubin = nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)
        _write_atomically(entry, cubin)
        _write_atomically(lowered_path, lowered.encode())
    module = function.Module()
    module.load(cubin)
    return ArchKernel(module.get_function(lowered))  # (the function keeps its module loaded)


class ArchKernel:
    """A kernel from compile_for_arch with what the launcher uses of cupy's RawKernel: the
    call and the dynamic shared-memory limit (a bare cupy Function has no such property)."""

    _MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def __init__(self, function):
        self.function = function

    def __call__(self, grid, block, args, shared_mem: int = 0):
        self.function(grid, block, args, shared_mem=shared_mem)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver

        return driver.funcGetAttribute(self._MAX_DYNAMIC_SHARED, self.function.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self.function.ptr, self._MAX_DYNAMIC_SHARED, nbytes)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write by rename, so a concurrent reader sees the whole file or none (a cache miss)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            handle.write(data)
        os.replace(handle.name, path)
    except OSError:  # an unwritable cache costs the next process a compile, nothing more
        pass


def launch_on_torch_stream(kernel, grid, block: int, args, shared: int = 0, programmatic: bool = False) -> None:
    """Launch a compiled cupy kernel on PyTorch's current stream (so it orders with the
    torch work around it and is captured into a CUDA graph with it). Arguments: a tensor
    passes its device pointer, None a null pointer, a float a float32, a numpy scalar itself,
    any other int an int32. programmatic: the kernel may start before the one ahead of it on
    the stream ends (programmatic_launch; the kernel must wait for it itself). A ctypes
    structure passes by value (a tensor map), through the driver as programmatic launches do."""
    import ctypes

    packed = pack_arguments(args)
    stream = torch.cuda.current_stream().cuda_stream
    if programmatic:
        from pagedweight_kernels.programmatic_launch import launch_programmatic

        launch_programmatic(kernel, grid, block, packed, shared, stream)
        return
    if any(isinstance(a, ctypes.Structure) for a in packed):
        from pagedweight_kernels.programmatic_launch import launch_driver

        launch_driver(kernel, grid, block, packed, shared, stream)
        return
    with _cupy_stream(stream):
        kernel(grid, (block,), tuple(packed), shared_mem=shared)


def pack_arguments(args) -> list:
    """Kernel arguments as numpy scalars, or ctypes structures as they are (launch_on_torch_stream's rules)."""
    import ctypes

    import numpy as np

    packed = []
    for a in args:
        if isinstance(a, torch.Tensor):
            packed.append(np.uint64(a.data_ptr()))
        elif a is None:
            packed.append(np.uint64(0))
        elif isinstance(a, float):
            packed.append(np.float32(a))
        elif isinstance(a, (np.generic, ctypes.Structure)):
            packed.append(a)
        else:
            packed.append(np.int32(a))
    return packed


@lru_cache(maxsize=64)
def _cupy_stream(handle: int):
    import warnings

    import cupy as cp

    with warnings.catch_warnings():  # cupy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(handle)


@lru_cache(maxsize=None)
def sm_count(index: int | None) -> int:
    """Streaming multiprocessors of CUDA device `index` (None: the current one): what grid
    sizes that fill the GPU are computed from."""
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).multi_processor_count
