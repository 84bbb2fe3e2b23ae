"""The streaming safetensors writer writes the file save_file writes, byte for byte, with
the tensors arriving one at a time in any order; and refuses a tensor it does not expect,
one written twice, or a file left incomplete."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.format.safetensors_writer import SafetensorsWriter


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    named = {}
    # names whose byte order differs from their numeric order (layers.10 < layers.2)
    for layer in (0, 2, 10):
        named[f"layers.{layer}.gate_up.planes"] = torch.randint(0, 256, (3, 8, 4, 2), generator=gen, dtype=torch.uint8)
        named[f"layers.{layer}.gate_up.lut3"] = torch.randn(3, 4, 8, generator=gen).half()
    named["h"] = torch.rand(5, 7, generator=gen)
    named["w"] = torch.randn(6, 2, generator=gen).bfloat16()
    named["ids"] = torch.randint(0, 99, (3,), generator=gen)
    named["odd"] = torch.randint(0, 9, (5,), generator=gen, dtype=torch.int8)  # header padding
    named["empty"] = torch.zeros(0, 4)
    return named


def test_bytes_equal_save_file_in_any_order(tmp_path):
    named = tensors()
    save_file(named, str(tmp_path / "reference.safetensors"))
    for trial in range(3):
        order = list(named)
        random.Random(trial).shuffle(order)
        path = tmp_path / f"streamed{trial}.safetensors"
        with SafetensorsWriter(path, {k: (v.dtype, v.shape) for k, v in named.items()}) as writer:
            for name in order:
                writer.write(name, named[name])
        assert path.read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
        loaded = load_file(str(path))
        assert all(torch.equal(loaded[k], v) for k, v in named.items())


def test_refuses_unexpected_duplicate_and_missing_tensors(tmp_path):
    named = tensors()
    specs = {k: (v.dtype, v.shape) for k, v in named.items()}
    with pytest.raises(ValueError, match="'h' is torch.float64"):
        with SafetensorsWriter(tmp_path / "a.safetensors", specs) as writer:
            writer.write("h", named["h"].double())
    with pytest.raises(ValueError, match="'nope': not in the file"):
        with SafetensorsWriter(tmp_path / "b.safetensors", specs) as writer:
            writer.write("nope", named["h"])
    with pytest.raises(ValueError, match="'h': written twice"):
        with SafetensorsWriter(tmp_path / "c.safetensors", specs) as writer:
            writer.write("h", named["h"])
            writer.write("h", named["h"])
    with pytest.raises(ValueError, match="1 tensors never written.*'w'"):
        with SafetensorsWriter(tmp_path / "d.safetensors", specs) as writer:
            for name in named:
                if name != "w":
                    writer.write(name, named[name])
