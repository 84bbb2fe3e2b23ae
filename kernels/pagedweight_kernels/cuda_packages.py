"""Where a kernel can run (a CUDA device and the package that builds it: cupy, triton), the
CUDA text a cupy module compiles, and how its kernels launch on PyTorch's stream."""

from __future__ import annotations

import importlib
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


def launch_on_torch_stream(kernel, grid, block: int, args, shared: int = 0) -> None:
    """Launch a compiled cupy kernel on PyTorch's current stream (so it orders with the
    torch work around it and is captured into a CUDA graph with it). Arguments: a tensor
    passes its device pointer, None a null pointer, a float a float32, a numpy scalar itself,
    any other int an int32."""
    import numpy as np

    packed = []
    for a in args:
        if isinstance(a, torch.Tensor):
            packed.append(np.uint64(a.data_ptr()))
        elif a is None:
            packed.append(np.uint64(0))
        elif isinstance(a, float):
            packed.append(np.float32(a))
        elif isinstance(a, np.generic):
            packed.append(a)
        else:
            packed.append(np.int32(a))
    with _cupy_stream(torch.cuda.current_stream().cuda_stream):
        kernel(grid, (block,), tuple(packed), shared_mem=shared)


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
