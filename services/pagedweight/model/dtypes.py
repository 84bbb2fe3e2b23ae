"""Activation and weight dtypes by the names flags and configs use."""

from __future__ import annotations

import torch

# name -> dtype (the names transformers' `torch_dtype` and our --dtype flags use)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
