"""Where a kernel can run (a CUDA device and the package that builds it: cupy, triton), and
the CUDA text a cupy module compiles."""

from __future__ import annotations

import importlib
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
