"""A safetensors file written one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; the quantiser's
experts file of a real-shape model is tens of GB (Qwen1.5-MoE-A2.7B: about 20 GB), more
than the host should hold to write it. When every tensor's name, dtype and shape are known
up front (they follow from the model config), the header and each tensor's offset are too:
this writer lays them out as save_file does (tensors sorted by dtype, larger dtypes first,
then by name; the header compact JSON padded with spaces to 8 bytes), writes the header,
and then each tensor at its offset whenever it arrives, in any order. The file is the one
save_file would have written, byte for byte (tests/format/test_safetensors_writer.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

# safetensors' dtype names, in the order of its Dtype enum (the sort key save_file uses)
_DTYPES = [(torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.int16, "I16"),
           (torch.float16, "F16"), (torch.bfloat16, "BF16"), (torch.int32, "I32"),
           (torch.float32, "F32"), (torch.float64, "F64"), (torch.int64, "I64")]
_NAME = dict(_DTYPES)
_RANK = {dtype: rank for rank, (dtype, _) in enumerate(_DTYPES)}


class SafetensorsWriter:
    """`specs`: tensor name -> (dtype, shape). Use as a context manager; `write` each tensor
    once; leaving the block without an exception checks that all were written."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        for name, (dtype, _) in specs.items():
            if dtype not in _NAME:
                raise ValueError(f"tensor {name!r}: dtype {dtype} is not supported")
        self.path = Path(path)
        self.specs = {name: (dtype, tuple(int(d) for d in shape)) for name, (dtype, shape) in specs.items()}
        order = sorted(self.specs, key=lambda n: (-_RANK[self.specs[n][0]], n.encode()))
        header, offset = {}, 0
        for name in order:
            dtype, shape = self.specs[name]
            size = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": _NAME[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._data_start = 8 + len(text)
        self._offsets = {name: record["data_offsets"][0] for name, record in header.items()}
        self._pending = set(self.specs)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._pending:
            raise ValueError(f"tensor {name!r}: " + ("written twice" if name in self.specs else "not in the file"))
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view, at = memoryview(data), self._data_start + self._offsets[name]
        while view:  # one write call moves at most ~2 GiB on Linux
            done = os.pwrite(self._file.fileno(), view, at)
            view, at = view[done:], at + done
        self._pending.discard(name)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self._file.close()
        if exc_type is None and self._pending:
            raise ValueError(f"{self.path}: {len(self._pending)} tensors never written "
                             f"(first: {sorted(self._pending)[0]!r})")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
