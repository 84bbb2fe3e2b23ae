"""Where a kernel can run: a CUDA device and the package that builds it (cupy, triton)."""

from __future__ import annotations

import importlib

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
