"""Tensor names, shapes and dtypes of a checkpoint, read from safetensors headers only.

A safetensors file starts with an 8-byte little-endian header length and a JSON header
naming every tensor's dtype, shape and byte range; reading it costs a few KB however big
the weights are. `pagedweight info` sizes a model from these headers and config.json
without loading a weight. Torch-free.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import CheckpointError

_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors dtype string: "BF16", "F32", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 0)


def read_headers(path: Path) -> list[TensorHeader]:
    """Every tensor of one .safetensors file, from its header alone."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > _MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {length} bytes)")
            raw = f.read(length)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in info["shape"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid dtype and shape in the header") from None
        if dtype not in DTYPE_BYTES or any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r} shape {shape}")
        tensors.append(TensorHeader(name, dtype, shape))
    return tensors


def checkpoint_headers(model_dir: Path) -> list[TensorHeader]:
    """Every tensor of a Hugging Face checkpoint directory (all its .safetensors shards)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files in the checkpoint directory")
    return [t for f in files for t in read_headers(f)]


def is_routed_expert(name: str) -> bool:
    """Routed-expert weights: `...experts.{e}...` (Mixtral, Qwen-MoE) or fused `...experts.gate_up_proj`.
    Shared experts (`shared_expert.`) stay dense."""
    return ".experts." in name
