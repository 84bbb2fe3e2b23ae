"""Kernel launches with CUDA's programmatic stream serialization (programmatic dependent launch,
sm_90+): the kernel may start while the one before it on the stream is still running, and waits
for it inside (`griddepcontrol.wait`) where it first needs that kernel's output. cupy launches
have no launch attributes, so this goes to the driver's cuLaunchKernelEx through ctypes.

The structures below mirror cuda.h (CUDA 12.0+): CUlaunchConfig, CUlaunchAttribute (an id, padding
to 8 bytes, a 64-byte value union). A launch captured into a CUDA graph keeps the programmatic
edge (CUDA 12.3+)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("as_u32", ctypes.c_uint), ("align", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int32): ctypes.c_int32,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32}


def kernel_parameters(packed) -> tuple[list, ctypes.Array]:
    """(the ctypes values, the void* array cuLaunchKernelEx reads) of arguments packed as numpy
    scalars (launch_on_torch_stream's packing), or ctypes structures passed by value (a tensor
    map). The values must outlive the launch call."""
    values = []
    for a in packed:
        if isinstance(a, ctypes.Structure):
            values.append(a)
            continue
        kind = _CTYPES.get(np.asarray(a).dtype)
        if kind is None:
            raise TypeError(f"no kernel parameter type for {type(a).__name__} {np.asarray(a).dtype}")
        values.append(kind(a.item()))
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return values, pointers


def function_handle(kernel) -> int:
    """The CUfunction of a compiled kernel: a cupy RawKernel (its loaded Function) or an
    ArchKernel (cuda_packages.compile_for_arch)."""
    function = getattr(kernel, "function", None) or getattr(kernel, "kernel", None)
    ptr = getattr(function, "ptr", None)
    if not ptr:
        raise TypeError(f"no CUfunction behind {type(kernel).__name__}")
    return int(ptr)


def cuda_driver():
    """libcuda (the driver API), loaded once, with the prototypes set that this module calls."""
    return _driver()


@lru_cache(maxsize=1)
def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
    driver.cuLaunchKernelEx.restype = ctypes.c_int
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    driver.cuGetErrorName.restype = ctypes.c_int
    return driver


@lru_cache(maxsize=1)
def _programmatic_attributes() -> ctypes.Array:
    """The one attribute every launch here passes (built once: launches are a host hot path)."""
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.as_u32 = 1
    return attrs


def launch_config(grid, block: int, shared: int, stream: int, attrs: ctypes.Array) -> LaunchConfig:
    gx, gy, gz = (tuple(grid) + (1, 1, 1))[:3]
    return LaunchConfig(gx, gy, gz, block, 1, 1, shared, ctypes.c_void_p(stream or None), attrs, len(attrs))


def launch_programmatic(kernel, grid, block: int, packed, shared: int, stream: int) -> None:
    """Launch `kernel` on `stream` (a CUstream handle) allowed to overlap the kernel before it."""
    launch_driver(kernel, grid, block, packed, shared, stream, programmatic=True)


def launch_driver(kernel, grid, block: int, packed, shared: int, stream: int, programmatic: bool = False) -> None:
    """Launch `kernel` on `stream` through cuLaunchKernelEx: for programmatic launches, and for
    parameters cupy cannot pass (a tensor map by value)."""
    config = launch_config(grid, block, shared, stream, _programmatic_attributes() if programmatic else _NO_ATTRIBUTES)
    values, pointers = kernel_parameters(packed)  # values: what pointers point at, alive through the call
    result = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function_handle(kernel)), pointers, None)
    if result:
        raise RuntimeError(f"cuLaunchKernelEx failed: {driver_error_name(result)} ({result})")


_NO_ATTRIBUTES = (LaunchAttribute * 0)()


def driver_error_name(result: int) -> str:
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    return (name.value or b"?").decode()
