"""The staged regime (apl_staged.cu) run on the CPU: build the harness (bench/staged_host_harness.cu)
with nvcc and run it, no GPU.

The harness includes the kernel module's text exactly as the launcher builds it (module_text) and is
compiled with the launcher's defines (kernel_defines, plus overrides); nvcc's host pass compiles the
kernel's APL_HD functions for the host, with kernels/pagedweight_kernels/apl_host.h's stand-ins for
their PTX. Its modes: `tiles` (the producer's A tiles of one block), `chunks` (tile_chunk's B
offsets) and `cta` (a whole projection launch, every CTA of the grid with its 256 threads as host
threads). Used by tests/kernels/test_staged_host_cpu.py and bench/staged_banks.py.

Usage: python -m bench.staged_host --projection gate_up|down --bits 4,3,4,3 [--rows-out N] [--cols N]
       [--tokens N] [--top-k K] [--dtype bf16|fp16] [--knobs "APL_X=1"] --out launch.pt
runs one launch on the CPU and saves its output beside the torch reference (nvcc, no GPU).
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.sass_mix import kernel_defines, module_text
from pagedweight_kernels import apl_moe as op
from pagedweight_kernels.apl_moe import DEFAULT_CONFIG, GemmPlan, KernelConfig, staged_class, staged_plan, widest_by_class
from pagedweight_kernels.moe_reference import expert_bounds, gated, group_tokens_by_expert
from pagedweight_kernels.synthetic import random_block, ragged_routing

HARNESS = Path(__file__).with_name("staged_host_harness.cu")
KERNELS = Path(__file__).parents[1] / "kernels" / "pagedweight_kernels"
ST_ROWS, ST_KS = 128, 64  # apl_staged.cu: weight rows a CTA, columns a step


def build_harness(work: Path, defines: dict[str, int], instance: tuple | None = None) -> Path:
    """The harness for these defines, and with `instance` (CLS, MODE, BF16, V4, NT8) its cta mode
    for that apl_staged instance; raises RuntimeError with nvcc's message."""
    (work / "module.cu").write_text(module_text(staged=True))
    cta = [] if instance is None else [f"-DHOST_{k}={str(v).lower()}" for k, v in zip(("CLS", "MODE", "BF16", "V4", "NT8"), instance)]
    # PTX only for the device pass (the host pass is what runs; no ptxas time)
    build = subprocess.run(["nvcc", "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=compute_90a", f"-I{KERNELS}",
                            f"-I{work}", *(f"-D{k}={v}" for k, v in defines.items()), *cta, str(HARNESS),
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


def knob_overrides(text: str) -> dict[str, int]:
    """Knob values from "APL_X=1,APL_Y=0" (names of KernelConfig.knobs())."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if name not in DEFAULT_CONFIG.knobs() or not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--knobs: {item!r} is not NAME=integer for a knob of {sorted(DEFAULT_CONFIG.knobs())}")
        overrides[name] = int(value)
    return overrides


def planned(case: dict, config: KernelConfig = DEFAULT_CONFIG) -> tuple[tuple, GemmPlan, int]:
    """(instance, plan, lut_bits) as staged_projection picks them for the case's blocks under `config`
    (the one the harness's kernel is compiled with: its plane ring's bytes follow the knobs)."""
    cls, lut_bits = staged_class(widest_by_class(case["bits"]))
    aligned16 = case["cols"] % 128 == 0  # (the harness's plane blobs are 16-byte aligned)
    assignments = case["num_tokens"] * case["top_k"]
    plan = staged_plan(case["mode"], case["num_tokens"], case["top_k"], len(case["bits"]), case["rows_out"], cls,
                       lut_bits, min(len(case["bits"]), assignments), aligned16, config)
    bf16 = case["dtype"] == torch.bfloat16
    return (cls, case["mode"], bf16, aligned16, plan.tiles), plan, lut_bits


def run_launch(harness: Path, work: Path, case: dict, plan: GemmPlan, lut_bits: int, stages: int | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """The harness's cta mode over every CTA of the plan's grid; the output is left in work/out.bin."""
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
    return subprocess.run([str(harness), "cta", str(work / "in.bin"), str(work / "out.bin")],
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


# ---------------------------------------------------------------- command line
def _bits_list(text: str) -> list[int]:
    bits = [int(b) for b in text.split(",") if b.strip()]
    if not bits or any(b < 3 or b > 8 for b in bits) or len(bits) > 64:
        raise ValueError(f"--bits wants 1-64 widths from 3 to 8, comma-separated, got {text!r}")
    return bits


def main(argv=None) -> int:
    """One projection launch run on the CPU, saved beside its torch reference: what a failing GPU
    test of the staged regime can be compared with, launch for launch."""
    parser = argparse.ArgumentParser(description="Run one apl_staged launch on the CPU (no GPU) and save it "
                                                 "with its torch reference.")
    parser.add_argument("--projection", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--bits", default="4,3,4,3", help="one width (3-8) per expert, comma-separated")
    parser.add_argument("--rows-out", type=int, default=96, help="h columns (gate_up) or output rows (down)")
    parser.add_argument("--cols", type=int, default=256, help="the projection's input width, a multiple of 32")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--knobs", default="", help='kernel knobs, "APL_X=1,APL_Y=0" (KernelConfig.knobs() names)')
    parser.add_argument("--out", required=True, help="a .pt file: output, reference, instance and plan")
    args = parser.parse_args(argv)
    try:
        bits = _bits_list(args.bits)
        overrides = knob_overrides(args.knobs)
        if not (0 < args.rows_out <= 4096 and 0 < args.cols <= 8192 and args.cols % 32 == 0
                and 0 < args.tokens <= 4096 and 0 < args.top_k <= len(bits)):
            raise ValueError("want 0 < rows-out <= 4096, cols a multiple of 32 up to 8192, "
                             "0 < tokens <= 4096 and 0 < top-k <= the number of experts")
    except ValueError as err:
        print(f"staged_host: {err}", file=sys.stderr)
        return 2
    if not shutil.which("nvcc"):
        print("staged_host: nvcc not found on PATH", file=sys.stderr)
        return 2
    mode = 0 if args.projection == "gate_up" else 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    case = projection_case(mode, bits, args.rows_out, args.cols, args.tokens, args.top_k, dtype, args.seed)
    try:
        instance, plan, lut_bits = planned(case, DEFAULT_CONFIG.with_knobs(**overrides))
    except op.APLKernelError as err:
        print(f"staged_host: {err}", file=sys.stderr)
        return 2
    print(f"staged_host: apl_staged<{', '.join(str(v).lower() for v in instance)}>, grid {plan.grid}, "
          f"{plan.stages} buffers; building", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            harness = build_harness(Path(tmp), kernel_defines(overrides), instance)
            print(f"staged_host: running {plan.grid[0] * plan.grid[1] * plan.grid[2]} CTAs", file=sys.stderr, flush=True)
            run = run_launch(harness, Path(tmp), case, plan, lut_bits)
            if run.returncode:
                raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
            got = launch_output(Path(tmp), case)
        except (RuntimeError, ValueError, OSError) as err:
            print(f"staged_host: {err}", file=sys.stderr)
            return 2
    want = reference_projection(case)
    try:
        torch.save({"output": got, "reference": want, "instance": instance, "grid": plan.grid, "stages": plan.stages,
                    "shared_bytes": plan.shared_bytes, "args": vars(args)}, args.out)
    except (OSError, RuntimeError) as err:
        print(f"staged_host: cannot write {args.out}: {err}", file=sys.stderr)
        return 2
    rows = ~torch.isnan(want).all(1)
    print(f"max |output - reference| {float((got[rows] - want[rows]).abs().max()):.3g} over {int(rows.sum())} rows; "
          f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
