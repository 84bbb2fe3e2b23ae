"""The staged regime (apl_staged.cu) run on the CPU: build the harness (staged_host_harness.cu
beside this file) with nvcc and run it, no GPU.

The harness includes the kernel module's text exactly as the launcher builds it (module_text) and is
compiled with the launcher's defines (kernel_defines, plus overrides); nvcc's host pass compiles the
kernel's APL_HD functions for the host, with apl_host.h's stand-ins (beside this file) for their
PTX. Its modes: `tiles` (the producer's A tiles of one block), `convert` (the dtype
conversions), `luts` (the row tables' values) and `cta` (a whole projection launch, every CTA of
the grid with its threads as host threads; with APL_HOST_BANKS set it also counts the shared-memory
bank wavefronts of the producers' accesses, `bank_counts`). One build holds the cta mode of
every instance it is given: most of a build's time (~8 s) is the module and the other modes, each
instance adds ~1.5 s. Used by tests/kernels/test_staged_host_cpu.py.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import torch

from bench.sass_mix import module_text
from pagedweight_kernels.apl_moe import DEFAULT_CONFIG, KernelConfig
from pagedweight_kernels.moe_reference import expert_bounds, gated, group_tokens_by_expert
from pagedweight_kernels.synthetic import random_block, ragged_routing
from pagedweight_kernels.layer import widest_by_class
from pagedweight_kernels.plan import GemmPlan, staged_class, staged_plan

HARNESS = Path(__file__).with_name("staged_host_harness.cu")
ST_ROWS, ST_KS = 128, 64  # apl_staged.cu: weight rows a CTA, columns a step


def instance_name(instance: tuple) -> str:
    """The harness's name of an apl_staged instance (CLS, MODE, BF16, V4, NT8): `0,0,true,true,2`."""
    return ",".join(str(v).lower() for v in instance)


def build_harness(work: Path, defines: dict[str, int], instances=()) -> Path:
    """The harness for these defines, with the cta mode of each apl_staged instance in `instances`
    ((CLS, MODE, BF16, V4, NT8) tuples); raises RuntimeError with nvcc's message."""
    (work / "module.cu").write_text(module_text(staged=True))
    listed = "".join(f" X({instance_name(instance)})" for instance in instances)
    (work / "harness_instances.h").write_text(f"#define HOST_INSTANCES(X){listed}\n")
    # PTX only for the device pass (the host pass is what runs; no ptxas time)
    build = subprocess.run(["nvcc", "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=compute_90a", f"-I{work}",
                            *(f"-D{k}={v}" for k, v in defines.items()), str(HARNESS),
                            "-o", str(work / "harness")], capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(build.stderr[-4000:])
    return work / "harness"


def projection_case(mode: int, bits: list[int], rows_out: int, cols: int, num_tokens: int, top_k: int,
                    dtype: torch.dtype, seed: int) -> dict:
    """A layer projection with one block per expert at these bits, a skewed routing, the
    projection's input and the expert-sorted assignments, as apl_moe's launch would see them."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * rows_out if mode == 0 else rows_out
    blocks = [random_block(rows, cols, gen) for _ in bits]
    topk_ids, _ = ragged_routing(num_tokens, len(bits), top_k, seed=seed)
    order, counts = group_tokens_by_expert(topk_ids, len(bits))
    active = [(e, start, end - start) for e, start, end in expert_bounds(counts.tolist())]
    x_rows = num_tokens if mode == 0 else num_tokens * top_k  # down reads h in sorted order
    x = torch.randn(x_rows, cols, generator=gen).to(dtype)
    return {"mode": mode, "bits": bits, "blocks": blocks, "rows_out": rows_out, "cols": cols, "top_k": top_k,
            "num_tokens": num_tokens, "sorted_slot": order.to(torch.int32), "active": active, "x": x, "dtype": dtype}


def planned(case: dict, config: KernelConfig = DEFAULT_CONFIG) -> tuple[tuple, GemmPlan, int]:
    """(instance, plan, lut_bits) as staged_projection picks them for the case's blocks under `config`."""
    cls, lut_bits = staged_class(widest_by_class(case["bits"]))
    aligned16 = case["cols"] % 128 == 0  # (the harness's plane blobs are 16-byte aligned)
    assignments = case["num_tokens"] * case["top_k"]
    plan = staged_plan(case["mode"], case["num_tokens"], case["top_k"], len(case["bits"]), case["rows_out"], cls,
                       lut_bits, min(len(case["bits"]), assignments), aligned16, config)
    bf16 = case["dtype"] == torch.bfloat16
    return (cls, case["mode"], bf16, aligned16, plan.tiles), plan, lut_bits


def run_launch(harness: Path, instance: tuple, work: Path, case: dict, plan: GemmPlan, lut_bits: int,
               stages: int | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """The harness's cta mode of `instance` over every CTA of the plan's grid; the output is left
    in work/out.bin."""
    gx, gy, gz = plan.grid
    assignments = case["num_tokens"] * case["top_k"]
    head = [len(case["bits"]), case["rows_out"], case["cols"], case["top_k"], lut_bits, stages or plan.stages,
            gx, gy, gz, plan.shared_bytes, assignments, case["x"].shape[0], len(case["active"])]
    parts = [struct.pack("<13i", *head)]
    for b, block in zip(case["bits"], case["blocks"]):
        parts += [struct.pack("<i", b), block.lut(b).contiguous().view(torch.int16).numpy().astype("<i2").tobytes(),
                  block.planes[:b].contiguous().numpy().tobytes()]
    parts += [np.asarray(case["active"], dtype="<i4").tobytes(), case["sorted_slot"].numpy().astype("<i4").tobytes(),
              case["x"].view(torch.int16).numpy().astype("<i2").tobytes()]
    (work / "in.bin").write_bytes(b"".join(parts))
    return subprocess.run([str(harness), "cta", instance_name(instance), str(work / "in.bin"), str(work / "out.bin")],
                          capture_output=True, text=True, timeout=600, env=env)


def launch_output(work: Path, case: dict) -> torch.Tensor:
    """The launch's output as fp32 [assignments, rows_out] (h by sorted position, y by slot);
    raises ValueError where an element was never written."""
    shape = (case["num_tokens"] * case["top_k"], case["rows_out"])
    if case["mode"] == 0:
        raw = np.fromfile(work / "out.bin", dtype="<i2").reshape(shape)
        if np.any(raw == -1):
            raise ValueError("an h element no CTA wrote")
        return torch.from_numpy(raw.copy()).view(case["dtype"]).float()
    raw = np.fromfile(work / "out.bin", dtype="<i4").reshape(shape)
    if np.any(raw == -1):
        raise ValueError("a y element no CTA wrote")
    return torch.from_numpy(raw.copy()).view(torch.float32)


def reference_projection(case: dict) -> torch.Tensor:
    """fp32 [assignments, rows_out]: gate_up's act(gate) * up by sorted position, down's rows by
    slot, from the blocks dequantised to the activation dtype (as the kernels' LUTs are)."""
    rows_out, top_k, slot = case["rows_out"], case["top_k"], case["sorted_slot"].long()
    out = torch.full((case["num_tokens"] * top_k, rows_out), float("nan"))
    for e, start, n in case["active"]:
        w = case["blocks"][e].dequantize(case["bits"][e], case["dtype"]).float()
        s = torch.arange(start, start + n)
        if case["mode"] == 0:
            y = case["x"][slot[s] // top_k].float() @ w.T
            out[s] = gated(y[:, :rows_out], y[:, rows_out:], case.get("activation", "silu")).to(case["dtype"]).float()
        else:
            out[slot[s]] = case["x"][s].float() @ w.T
    return out


def bank_case(bits: int) -> dict:
    """The launch bank_counts runs: down, 128 rows, 512 columns, 80 tokens x top-2 over 4 experts at `bits`."""
    return projection_case(1, [bits] * 4, 128, 512, 80, 2, torch.bfloat16, seed=1)


def bank_counts(harness: Path, bits: int, work: Path) -> dict:
    """Shared-memory bank wavefronts of bank_case(bits)'s producers, on a harness built with its
    instance: per instruction kind issued (the A tiles' STS.128, the plane words' cp.async, the
    plane ring's LDS.128), its warp instructions, the wavefronts 32 banks of 4 bytes take (the
    most distinct words one bank is asked for, at least one per 128 bytes) and the fewest its
    bytes allow (`ideal`)."""
    case = bank_case(bits)
    instance, plan, lut_bits = planned(case)
    banks = work / "banks.json"
    run = run_launch(harness, instance, work, case, plan, lut_bits, env={**os.environ, "APL_HOST_BANKS": str(banks)})
    if run.returncode:
        raise RuntimeError(f"the harness failed: {run.stderr[-500:]}")
    return {kind: c for kind, c in json.loads(banks.read_text()).items() if c["instructions"]}


# Whole launches the CPU tests run: (mode, bits per expert, rows_out, cols, tokens, top_k, dtype,
# the instance staged_plan must pick)
LAUNCHES = {
    "gate_up_3_4_bits_16_token_passes": (0, [4, 3, 4, 3, 4, 3], 96, 256, 24, 2, torch.bfloat16, (0, 0, True, True, 2)),
    "down_3_4_bits_4_byte_loads_ragged_step": (1, [3, 4, 4, 3], 192, 160, 40, 2, torch.float16, (0, 1, False, False, 4)),
    "gate_up_5_8_bits_two_pass_groups": (0, [5, 6, 8, 7], 64, 128, 200, 2, torch.float16, (1, 0, False, True, 8)),
    "down_merged_class": (1, [3, 5, 4, 8, 6, 4], 128, 128, 64, 2, torch.bfloat16, (2, 1, True, True, 4)),
    "gate_up_96_token_passes": (0, [4, 3, 4, 4], 64, 256, 100, 2, torch.bfloat16, (0, 0, True, True, 12)),
}


def launch_case(name: str, seed: int, bits: list[int] | None = None) -> tuple[dict, tuple]:
    """(case, the instance it is written for) of LAUNCHES[name], its blocks at `bits` if given."""
    mode, case_bits, rows_out, cols, tokens, top_k, dtype, instance = LAUNCHES[name]
    return projection_case(mode, bits or case_bits, rows_out, cols, tokens, top_k, dtype, seed), instance
