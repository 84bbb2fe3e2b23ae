"""The staged regime's producer on the CPU: its dequantisation (register-LUT PRMT lookups with the
4x4 byte transpose at 3-4 bits, shared-memory LUT rows at 5-8 bits, staggered in a merged
launch's 256-entry rooms) and the A tiles it stores, checked bit for bit against the format's
reference dequantisation, no GPU.

staged_host/harness.cu is compiled by nvcc with the kernel module's text as the launcher builds it
and the launcher's defines (and once more with every knob of the lookup path flipped); its host
pass runs stage_weights, the function staged_produce calls per step, with apl_host.h's stand-ins
for the PTX. The tiles are read back here by the operand layout the consumer's descriptors
describe (the PTX ISA's no-swizzle K-major layout), written out independently of tile_chunk.
Skipped without nvcc."""

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.sass_mix import kernel_defines, module_text
from pagedweight_kernels.synthetic import random_block

HARNESS = Path(__file__).with_name("staged_host") / "harness.cu"
KERNELS = Path(__file__).parents[2] / "kernels" / "pagedweight_kernels"
ST_ROWS, ST_KS = 128, 64  # apl_staged.cu: weight rows a CTA, columns a step
# wgmma_desc (apl_gemv.cu): LBO 128 bytes between the two core matrices of a k16 slice (columns
# 0-7, 8-15), SBO 256 bytes between 8-row groups; a core matrix is 8 rows of 16 contiguous bytes.
LBO, SBO = 128, 256

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _flipped_knobs() -> dict[str, int]:
    """Every compile knob on the producer's lookup path set the other way from the launcher's."""
    d = kernel_defines({})
    return {"APL_PRMT_SELECT": 1 - d["APL_PRMT_SELECT"], "APL_SHIFT_MODE": 1 - d["APL_SHIFT_MODE"],
            "APL_GEMV_LUT16": 1 - d["APL_GEMV_LUT16"],
            "APL_FMA_SHIFTS_MIN_BITS": 3 if d["APL_FMA_SHIFTS_MIN_BITS"] != 3 else 9}


@pytest.fixture(scope="module", params=["launcher", "flipped"])
def harness(request, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp(f"staged_host_{request.param}")
    (work / "module.cu").write_text(module_text(staged=True))
    defines = kernel_defines(_flipped_knobs() if request.param == "flipped" else {})
    # PTX only for the device pass (the host pass is what runs; no ptxas time)
    build = subprocess.run(["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=compute_90a", f"-I{KERNELS}",
                            f"-I{work}", *(f"-D{k}={v}" for k, v in defines.items()), str(HARNESS),
                            "-o", str(work / "harness")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return work / "harness"


def operand_offsets(rows: int) -> np.ndarray:
    """Byte offset of element (m, k) of a [rows x 64] operand tile as the consumer's wgmma read it:
    k16 slice k // 16 at rows * 32 bytes a slice (staged_consume's descriptors), then the
    no-swizzle K-major layout of the descriptor."""
    m = np.arange(rows)[:, None]
    k = np.arange(ST_KS)[None, :]
    return (k // 16) * (rows * 32) + (m // 8) * SBO + ((k % 16) // 8) * LBO + (m % 8) * 16 + (k % 8) * 2


def staged_weights(harness: Path, work: Path, block, bits: int, bf16: bool, lut_log2: int, unit: int) -> np.ndarray:
    """The harness's A tiles, read back as the [rows, cols] weights the consumer multiplies (u16)."""
    lut = block.luts[bits].contiguous().view(torch.int16).numpy()
    planes = block.planes[:bits].contiguous().numpy()  # [bits, rows, cols / 8] bytes = little-endian words
    head = struct.pack("<6i", bits, ST_ROWS, block.cols, int(bf16), lut_log2, unit)
    (work / "in.bin").write_bytes(head + lut.astype("<i2").tobytes() + planes.tobytes())
    run = subprocess.run([str(harness), "tiles", str(work / "in.bin"), str(work / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    tiles = np.fromfile(work / "out.bin", dtype="<u2").reshape(block.cols // ST_KS, ST_ROWS * ST_KS)
    at = operand_offsets(ST_ROWS) // 2  # every element is 2-byte aligned
    return np.concatenate([tile[at] for tile in tiles], axis=1)


def reference(block, bits: int, bf16: bool) -> np.ndarray:
    """The format's dequantisation in the activation dtype (fp16 LUT entries, rounded to bf16
    as the kernels' lut_to_act does), as u16 bit patterns."""
    w = block.dequantize(bits)
    w = w.float().to(torch.bfloat16) if bf16 else w.to(torch.float16)
    return w.view(torch.int16).numpy().astype("<u2")


@pytest.mark.parametrize("unit", [2, 4])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [3, 4, 5, 6, 7, 8])
def test_staged_tiles_hold_the_reference_weights(harness, tmp_path, bits, bf16, unit):
    # 5 steps: a unit of 4 steps ends past the row (its last words clamped into it)
    block = random_block(ST_ROWS, 5 * ST_KS, torch.Generator().manual_seed(100 * bits + unit))
    got = staged_weights(harness, tmp_path, block, bits, bf16, lut_log2=bits, unit=unit)
    np.testing.assert_array_equal(got, reference(block, bits, bf16))


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_staged_tiles_from_a_merged_launchs_lut_rooms(harness, tmp_path, bits):
    # a merged launch sizes every row's room for 8 bits; 5-bit rows sit staggered in theirs
    block = random_block(ST_ROWS, 3 * ST_KS, torch.Generator().manual_seed(bits))
    got = staged_weights(harness, tmp_path, block, bits, True, lut_log2=8, unit=2)
    np.testing.assert_array_equal(got, reference(block, bits, True))


@pytest.mark.parametrize("tokens", [16, 32, 64, 96])
def test_activation_chunks_land_where_the_b_descriptors_read(harness, tmp_path, tokens):
    # B tiles ([tokens x 64], the pass's activations) are stored by tile_chunk too: chunk c of
    # token row r must hold elements (r, 8c .. 8c + 7) of the layout the consumer reads
    run = subprocess.run([str(harness), "chunks", str(tokens), str(tmp_path / "chunks.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    chunks = np.fromfile(tmp_path / "chunks.bin", dtype="<i4").reshape(tokens, 8)
    expected = operand_offsets(tokens)[:, ::8]
    np.testing.assert_array_equal(chunks, expected)
    assert np.all(np.diff(operand_offsets(tokens).reshape(tokens, 8, 8), axis=2) == 2)  # a chunk is contiguous


def test_harness_refuses_an_input_it_cannot_take(harness, tmp_path):
    (tmp_path / "in.bin").write_bytes(struct.pack("<6i", 9, ST_ROWS, ST_KS, 1, 8, 2))
    run = subprocess.run([str(harness), "tiles", str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "unsupported input" in run.stderr
    assert not (tmp_path / "out.bin").exists()
