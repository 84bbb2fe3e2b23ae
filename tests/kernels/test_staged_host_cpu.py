"""The staged regime (apl_staged.cu) on the CPU, no GPU:

1. its producer's dequantisation (register-LUT PRMT lookups with the 4x4 byte transpose at 3-4
   bits, shared-memory LUT rows at 5-8 bits, staggered in a merged launch's 256-entry rooms) and
   the A tiles it stores, bit for bit against the format's reference dequantisation;
2. whole launches: every CTA of staged_plan's grid, its threads (consumer and producer
   warpgroups) as host threads running staged_cta, the mbarrier ring, the passes and the
   epilogue, against a torch reference of the projection (gate_up's act(gate) * up, down's fp32
   rows), with wgmma computed by the PTX ISA's definition.

staged_host.py (beside this file) builds staged_host_harness.cu with nvcc from the kernel module's
text as the launcher builds it and the launcher's defines; its host pass runs the kernel's own
functions with apl_host.h's stand-ins for the PTX. The tiles are read back here by the operand
layout the consumer's descriptors describe (the PTX ISA's no-swizzle K-major layout), written out
independently of tile_chunk. What the emulation cannot show: timing, and a missing memory fence
(apl_host.h). Skipped without nvcc."""

import dataclasses
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.sass_mix import kernel_defines
from pagedweight_kernels.synthetic import random_block
from pagedweight_kernels.config import ACT_CODES, DEFAULT_CONFIG
from pagedweight_kernels.layer import APLKernelError
from pagedweight_kernels.plan import staged_min_stages, staged_plan, staged_plane_ring_bytes, staged_threads
from tests.kernels.staged_host import (LAUNCHES, ST_KS, ST_ROWS, bank_case, bank_counts, build_harness, launch_case,
                                       launch_output, planned, projection_case, reference_projection, run_launch)

# wgmma_desc (apl_gemv.cu): LBO 128 bytes between the two core matrices of a k16 slice (columns
# 0-7, 8-15), SBO 256 bytes between 8-row groups; a core matrix is 8 rows of 16 contiguous bytes.
LBO, SBO = 128, 256

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


# The launches beyond LAUNCHES (which name their instances): the 128-token passes and the two
# producer warpgroups, whose instances staged_plan picks.
WIDE = [(0, 64, torch.bfloat16), (1, 128, torch.float16)]  # mode, rows_out, dtype
TWO_PRODUCERS = [(1, [8, 5, 7, 6], 128, 640, 40, torch.bfloat16),  # mode, bits, rows_out, cols, tokens, dtype
                 (0, [4, 6, 3, 8], 64, 224, 150, torch.float16)]


def wide_case(mode: int, rows_out: int, dtype: torch.dtype) -> dict:
    return projection_case(mode, [4, 3, 4, 4], rows_out, 256, 150, 2, dtype, seed=19)


def two_producer_case(mode: int, bits: list[int], rows_out: int, cols: int, tokens: int, dtype: torch.dtype) -> dict:
    return projection_case(mode, bits, rows_out, cols, tokens, 2, dtype, seed=23)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """The harness with the cta mode of every instance the launches below run (the launcher's
    defines), built once: a build per instance would repeat the ~8 s they share."""
    picked = [wide_case(*p) for p in WIDE] + [two_producer_case(*p) for p in TWO_PRODUCERS] + [bank_case(4)]
    instances = {instance for *_, instance in LAUNCHES.values()} | {planned(case)[0] for case in picked}
    return build_harness(tmp_path_factory.mktemp("staged_host"), kernel_defines({}), sorted(instances))


def operand_offsets(rows: int) -> np.ndarray:
    """Byte offset of element (m, k) of a [rows x 64] operand tile as the consumer's wgmma read it:
    k16 slice k // 16 at rows * 32 bytes a slice (staged_consume's descriptors), then the
    no-swizzle K-major layout of the descriptor."""
    m = np.arange(rows)[:, None]
    k = np.arange(ST_KS)[None, :]
    return (k // 16) * (rows * 32) + (m // 8) * SBO + ((k % 16) // 8) * LBO + (m % 8) * 16 + (k % 8) * 2


def staged_weights(harness: Path, work: Path, block, bits: int, bf16: bool, lut_log2: int) -> np.ndarray:
    """The harness's A tiles, read back as the [rows, cols] weights the consumer multiplies (u16)."""
    lut = block.lut(bits).contiguous().view(torch.int16).numpy()
    planes = block.planes[:bits].contiguous().numpy()  # [bits, rows, cols / 8] bytes = little-endian words
    head = struct.pack("<5i", bits, ST_ROWS, block.cols, int(bf16), lut_log2)
    (work / "in.bin").write_bytes(head + lut.astype("<i2").tobytes() + planes.tobytes())
    run = subprocess.run([str(harness), "tiles", str(work / "in.bin"), str(work / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    tiles = np.fromfile(work / "out.bin", dtype="<u2").reshape(block.cols // ST_KS, ST_ROWS * ST_KS)
    at = operand_offsets(ST_ROWS) // 2  # every element is 2-byte aligned
    return np.concatenate([tile[at] for tile in tiles], axis=1)


def reference(block, bits: int, bf16: bool) -> np.ndarray:
    """The format's dequantisation in the activation dtype, as u16 bit patterns."""
    w = block.dequantize(bits, torch.bfloat16 if bf16 else torch.float16)
    return w.view(torch.int16).numpy().astype("<u2")


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [3, 4, 5, 6, 7, 8])
def test_staged_tiles_hold_the_reference_weights(harness, tmp_path, bits, bf16):
    # 5 steps: the last unit of 2 steps ends past the row (its last words clamped into it)
    block = random_block(ST_ROWS, 5 * ST_KS, torch.Generator().manual_seed(100 * bits + 2))
    got = staged_weights(harness, tmp_path, block, bits, bf16, lut_log2=bits)
    np.testing.assert_array_equal(got, reference(block, bits, bf16))


def test_harness_refuses_an_input_it_cannot_take(harness, tmp_path):
    (tmp_path / "in.bin").write_bytes(struct.pack("<5i", 9, ST_ROWS, ST_KS, 1, 8))
    run = subprocess.run([str(harness), "tiles", str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "unsupported input" in run.stderr
    assert not (tmp_path / "out.bin").exists()


# ---------------------------------------------------------------- whole launches
def assert_matches(got: torch.Tensor, want: torch.Tensor, case: dict) -> None:
    if case["mode"] == 0:  # h in the activation dtype: one rounding apart at most
        rtol = 2.0 ** -7 if case["dtype"] == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)
    else:  # fp32 sums of exact products, in another order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)




@pytest.mark.parametrize("name", list(LAUNCHES))
def test_staged_launch_matches_the_reference(harness, tmp_path, name):
    case, instance = launch_case(name, seed=len(name))
    picked, plan, lut_bits = planned(case)
    assert picked == instance, (picked, plan)  # the case exercises what it says
    run = run_launch(harness, instance, tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert_matches(launch_output(tmp_path, case), reference_projection(case), case)


@pytest.mark.parametrize("mode,rows_out,dtype", WIDE)
def test_128_token_passes_match_the_reference(harness, tmp_path, mode, rows_out, dtype):
    # staged_wide_nt8 16 (the default): 75 tokens an expert want 15 tiles, so passes of 128, the
    # consumers' m64n128 wgmma; the hot expert's 150 assignments take a second, partial pass
    assert DEFAULT_CONFIG.staged_wide_nt8 == 16
    case = wide_case(mode, rows_out, dtype)
    picked, plan, lut_bits = planned(case)
    assert picked == (0, mode, dtype == torch.bfloat16, True, 16) and plan.tokens == 128, (picked, plan)
    assert max(n for _, _, n in case["active"]) > 128  # (two passes for the hot expert)
    run = run_launch(harness, picked, tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert_matches(launch_output(tmp_path, case), reference_projection(case), case)


# The 5-8-bit and merged classes' two producer warpgroups, the second taking every other unit (2 steps) of
# each pass. Rows long enough that both have units: down at 5-8 bits, 10 steps (5 units, 3 and 2), 16-byte
# plane loads; merged gate_up, 224 columns (4 steps, the last ragged), 4-byte loads; hot experts in two passes.
@pytest.mark.parametrize("mode,bits,rows_out,cols,tokens,dtype", TWO_PRODUCERS)
def test_two_producer_warpgroups_match_the_reference(harness, tmp_path, mode, bits, rows_out, cols, tokens, dtype):
    case = two_producer_case(mode, bits, rows_out, cols, tokens, dtype)
    picked, plan, lut_bits = planned(case)
    run = run_launch(harness, picked, tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert picked[0] != 0 and staged_threads(picked[0]) == 384
    # (a hot expert's second pass: where a pass has an odd count of units, a warpgroup's next step can be
    # more ring buffers ahead than the ring holds, which its waits must survive)
    assert plan.tokens < max(n for _, _, n in case["active"])
    assert_matches(launch_output(tmp_path, case), reference_projection(case), case)


def test_two_producer_warpgroups_need_a_ring_of_three():
    # a warpgroup's next step can be 3 buffers on from its last (its unit of 2 steps, then the other's
    # 2): a ring of 2 would let its parity wait run a lap ahead, so the plan asks for 3 or refuses
    case = projection_case(1, [8, 5, 7, 6], 128, 640, 40, 2, torch.bfloat16, seed=23)
    assert staged_min_stages(1) == staged_min_stages(2) == 3 and staged_min_stages(0) == 2
    two = dataclasses.replace(DEFAULT_CONFIG, staged_stages=2)
    plan = planned(case, two)[1]
    assert plan.stages == 3
    with pytest.raises(APLKernelError, match="needs 3 ring buffers"):
        planned(case, dataclasses.replace(two, staged_cta_shared=(plan.shared_bytes - 1,) * 2))


def test_blocks_outside_the_launchs_class_come_out_nan(harness, tmp_path):
    # a 3-4-bit launch over a layer with one 6-bit block: that expert's outputs are NaN, the rest exact
    case, instance = launch_case("gate_up_3_4_bits_16_token_passes", seed=7, bits=[4, 6, 4, 3, 4, 3])
    plan = staged_plan(case["mode"], case["num_tokens"], case["top_k"], 6, case["rows_out"], 0, 0, 6, True)
    assert plan.tiles == instance[-1]
    run = run_launch(harness, instance, tmp_path, case, plan, lut_bits=0)
    assert run.returncode == 0, run.stderr[-2000:]
    got, want = launch_output(tmp_path, case), reference_projection(case)
    bad = next((start, n) for e, start, n in case["active"] if e == 1)
    rows = torch.arange(bad[0], bad[0] + bad[1])
    assert bad[1] > 0 and torch.isnan(got[rows]).all()
    keep = torch.ones(got.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert_matches(got[keep], want[keep], case)


def test_a_ring_of_one_buffer_deadlocks(harness, tmp_path):
    # why staged_plan refuses one buffer: the consumers hand a buffer back only after issuing the
    # next step's wgmma, so with one the producers and consumers wait on each other for ever
    case, instance = launch_case("gate_up_3_4_bits_16_token_passes", seed=3)
    _, plan, lut_bits = planned(case)
    env = {**os.environ, "APL_HOST_DEADLOCK_S": "2"}
    run = run_launch(harness, instance, tmp_path, case, plan, lut_bits, stages=1, env=env)
    assert run.returncode == 3 and "deadlock" in run.stderr  # (staged_plan refuses it: test_apl_moe_cpu)


@pytest.mark.parametrize("name", ["gate_up_3_4_bits_16_token_passes", "gate_up_5_8_bits_two_pass_groups"])
def test_a_ring_of_two_buffers(harness, tmp_path, name):
    # the fewest staged_plan gives (where shared memory is short): each buffer is refilled while the
    # next step's wgmma run, so a buffer handed back before its own wgmma were waited for shows here
    case, instance = launch_case(name, seed=11)
    _, plan, lut_bits = planned(case)
    run = run_launch(harness, instance, tmp_path, case, plan, lut_bits, stages=2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert_matches(launch_output(tmp_path, case), reference_projection(case), case)




def test_the_plane_ring_lives_in_the_bytes_the_host_plans(harness, tmp_path):
    # the harness gives each CTA exactly the plan's shared bytes: with the plane ring's bytes left out
    # of the plan, a launch that reads its plane words through it reaches past them
    case, instance = launch_case("gate_up_3_4_bits_16_token_passes", seed=5)
    _, plan, lut_bits = planned(case)
    ring = staged_plane_ring_bytes(0)
    assert ring > 0
    short = dataclasses.replace(plan, shared_bytes=plan.shared_bytes - ring)
    run = run_launch(harness, instance, tmp_path, case, short, lut_bits)
    assert run.returncode != 0 and "past the CTA's" in run.stderr


def test_gate_up_with_gelu(tmp_path):
    # Gemma-4's experts: APL_ACT 1, GELU's tanh form (the launcher compiles gate_up once per activation)
    case, instance = launch_case("gate_up_3_4_bits_16_token_passes", seed=13)
    case["activation"] = "gelu_tanh"
    _, plan, lut_bits = planned(case)
    gelu = build_harness(tmp_path, kernel_defines({"APL_ACT": ACT_CODES["gelu_tanh"]}), [instance])
    run = run_launch(gelu, instance, tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert_matches(launch_output(tmp_path, case), reference_projection(case), case)


# ---------------------------------------------------------------- bank conflicts
def test_producer_stores_and_copies_take_the_fewest_wavefronts(harness, tmp_path):
    # the A tiles' STS.128, the plane words' 16-byte cp.async, the plane ring's LDS.128 (the activations
    # come by TMA, which the count leaves out)
    got = bank_counts(harness, 4, tmp_path)
    assert set(got) == {"STS.128", "LDGSTS.16", "LDS.128"}
    for kind, c in got.items():
        assert c["instructions"] > 0 and c["wavefronts"] == c["ideal"], (kind, c)


# ---------------------------------------------------------------- the emulation's own parts
def test_the_emulated_conversions_round_as_torch_does(harness, tmp_path):
    # cvt.rn.f16.f32 / cvt.rn.bf16.f32 / cvt.f32.f16 on the host (apl_host.h), against torch's casts
    # (round to nearest even): every fp16 tie, bf16 ties, subnormals, overflow, infinities, NaN
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14,
                            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, float("inf"), -float("inf")])
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    # every tie: the midpoints of consecutive finite fp16 values (subnormals included) and of a
    # sample of consecutive bf16 values, exact in fp32
    ordered = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    half_ties = ((ordered[1:] + ordered[:-1]) / 2).float()
    b16 = torch.randint(0, 0x7F80, (20_000,), generator=gen, dtype=torch.int32)
    lo, hi = (b16 << 16).view(torch.float32).double(), ((b16 + 1) << 16).view(torch.float32).double()
    bf16_ties = ((lo + hi) / 2).float()
    x = torch.cat([bits.view(torch.float32), special, halves, halves * (1 + 2.0**-12), half_ties, -half_ties,
                   bf16_ties, -bf16_ties])
    x = x[~torch.isnan(x)]  # (NaN payloads differ by design; a NaN is checked to stay a NaN below)
    x = torch.cat([x, torch.tensor([float("nan")])])
    (tmp_path / "in.bin").write_bytes(x.numpy().astype("<f4").tobytes())
    run = subprocess.run([str(harness), "convert", str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    n = x.numel()
    narrowed = torch.from_numpy(out[:4 * n].copy().view("<i2").astype(np.int16))
    widened = torch.from_numpy(out[4 * n:].copy().view("<f4").astype(np.float32))
    half, bf16 = narrowed[:n].view(torch.float16), narrowed[n:].view(torch.bfloat16)
    assert torch.equal(half[:-1].view(torch.int16), x[:-1].half().view(torch.int16))
    assert torch.equal(bf16[:-1].view(torch.int16), x[:-1].bfloat16().view(torch.int16))
    assert torch.isnan(half[-1].float()) and torch.isnan(bf16[-1].float())
    all_halves = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    assert torch.equal(torch.isnan(widened), torch.isnan(all_halves))
    finite = ~torch.isnan(all_halves)
    assert torch.equal(widened[finite].view(torch.int32), all_halves[finite].view(torch.int32))


# ---------------------------------------------------------------- the derived tables
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,mode", [(3, "luts"), (4, "luts"), (5, "luts"), (6, "luts"), (7, "luts"), (8, "luts"),
                                       (5, "cells"), (6, "cells"), (7, "cells"), (8, "cells")])
def test_kernel_tables_equal_the_format_s_bit_for_bit(harness, tmp_path, bits, mode, dtype):
    """Every code's value as the kernels' row tables compute it (`luts`: RowLut, dequant_chunks;
    `cells`: the decode regime's shared-memory cell table, CellTab.select2) against
    apl_format.expand_lut on sorted, unsorted, tiny, huge and repeated centroids and zero extents:
    the same bits in both activation dtypes."""
    from pagedweight.format.apl_format import expand_lut, lut_entries

    gen = torch.Generator().manual_seed(bits)
    rows = 512
    lut = torch.randn(rows, lut_entries(bits), generator=gen) * torch.logspace(-6, 3, rows)[:, None]
    lut[: rows // 2, :16 if bits > 3 else 8] = lut[: rows // 2, :16 if bits > 3 else 8].sort(dim=1).values
    if bits > 3:
        lut[:, 16] = lut[:, 16].abs()
        lut[::7, 16] = 0.0  # no room beyond the outer centroids
        lut[::5, 3:6] = lut[::5, 3:4]  # repeated centroids: empty inner cells
    stored = lut.to(torch.float16)
    (tmp_path / "in.bin").write_bytes(struct.pack("<3i", bits, rows, int(dtype == torch.bfloat16))
                                      + stored.view(torch.int16).numpy().astype("<i2").tobytes())
    run = subprocess.run([str(harness), mode, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    table = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype="<i2").astype(np.int16)).view(rows, 1 << bits)
    assert torch.equal(table, expand_lut(stored, bits, dtype).view(torch.int16))
