"""Tensor names, shapes and dtypes of a checkpoint, read from safetensors headers only.

A safetensors file starts with an 8-byte little-endian header length and a JSON header
naming every tensor's dtype, shape and byte range; reading it costs a few KB however big
the weights are. `pagedweight info` sizes a model from these headers and config.json
without loading a weight. Torch-free.

The files are untrusted, and every command finds them the same way (`checkpoint_files`,
which the loader uses too): the shards the index names, or `model.safetensors`, each a
regular file inside the model directory. A header is believed only as far as the file
bears it out: each tensor's byte range must lie inside the file and hold exactly its
shape's bytes, so a truncated file or a header claiming [2^31, 2^31] is refused.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import CheckpointError
from pagedweight.common.json_files import read_json_object
from pagedweight.common.safe_paths import model_file

_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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
        # O_NONBLOCK: opening a FIFO returns at once (and is refused below) instead of hanging
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > min(_MAX_HEADER_BYTES, st.st_size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {length} bytes)")
            raw = f.read(length)
            num_data_bytes = st.st_size - 8 - length
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
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name[:80]!r} has no valid dtype, shape and data_offsets "
                                  f"in the header") from None
        if dtype not in DTYPE_BYTES or any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name[:80]!r} has dtype {dtype!r} shape {shape}")
        tensor = TensorHeader(name, dtype, shape)
        if not 0 <= begin <= end <= num_data_bytes:
            raise CheckpointError(f"{path}: tensor {name[:80]!r} lies past the end of the file (bytes {begin}..{end} "
                                  f"of {num_data_bytes}): truncated or not a safetensors file")
        if end - begin != tensor.nbytes:
            raise CheckpointError(f"{path}: tensor {name[:80]!r} of shape {shape} ({dtype}) needs {tensor.nbytes} "
                                  f"bytes; the header gives it {end - begin}")
        tensors.append(tensor)
    return tensors


def shard_index(model_dir: Path) -> dict[str, str] | None:
    """The shard index's weight_map (tensor name -> shard file name), each shard a regular
    file inside the model directory; None for a checkpoint of one model.safetensors."""
    model_dir = Path(model_dir)
    index = model_file(model_dir, INDEX_FILE)
    if index is None:
        return None
    weight_map = read_json_object(index, "shard index", CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: malformed shard index (expected a \"weight_map\" object "
                              f"from tensor names to shard file names)")
    for shard in sorted(set(weight_map.values())):
        if model_file(model_dir, shard) is None:
            raise CheckpointError(f"{model_dir / shard}: shard listed in {INDEX_FILE} is missing")
    return weight_map


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, else model.safetensors."""
    model_dir = Path(model_dir)
    weight_map = shard_index(model_dir)
    if weight_map is not None:
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    single = model_file(model_dir, SINGLE_FILE)
    if single is None:
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
    return [single]


def checkpoint_headers(model_dir: Path) -> list[TensorHeader]:
    """Every tensor of a Hugging Face checkpoint directory (all its shards); with an index,
    the index must say where every tensor is, and only there (as the loader checks)."""
    model_dir = Path(model_dir)
    weight_map = shard_index(model_dir)
    tensors = []
    for path in checkpoint_files(model_dir):
        in_file = read_headers(path)
        if weight_map is not None:
            shard = path.relative_to(model_dir).as_posix()
            listed = {k for k, v in weight_map.items() if v == shard}
            stored = {t.name for t in in_file}
            if listed != stored:
                odd = sorted(listed ^ stored)[0]
                raise CheckpointError(f"{path}: {INDEX_FILE} and the shard disagree about tensor {odd[:80]!r}")
        tensors += in_file
    return tensors


def is_routed_expert(name: str) -> bool:
    """Routed-expert weights: `...experts.{e}...` (Mixtral, Qwen-MoE) or fused `...experts.gate_up_proj`.
    Shared experts (`shared_expert.`) stay dense."""
    return ".experts." in name
