"""The staged regime's instances without a GPU (docs/kernel.md, "The staged regime"): compiles
every `apl_staged` instance the host can launch (classes, projections, 16-byte plane loads or
not, passes of 8 * NT8 tokens) as bench/sass_mix does and records ptxas's registers and spills;
then, per bit width and pass width, the producer warpgroup's step loop in instructions per
dequantised weight (bench/sass_mix.producer_loop_mixes).

A kernel of a class holds one producer loop per width, and nothing in the SASS says which is
which, so the widths are counted from a probe: a kernel with the same launch bounds and producer
register budget (setmaxnreg) whose body is apl_staged.cu's producer for one width only.

Usage: python -m bench.staged_sass [--dtype bf16|fp16] [--out NAME]   (nvcc and nvdisasm, no GPU;
NVDISASM names nvdisasm where it is not on PATH: the `nvidia-cuda-nvdisasm` wheel ships one;
APL_KERNEL_DEFINES="APL_STAGED_PLANE_ASYNC=1" counts a knob's build, as the host would compile it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import sass_mix
from bench.bench_meta import write_result


PROBE_PARAMS = ("const long long* __restrict__, StagedWork, const int* __restrict__, int, const u16* __restrict__, "
                "const u16*, int, const __grid_constant__ StagedTensorMap")
PROBE = """
template <int B, int MODE, bool BF16, bool V4, int NT8>
__global__ void __launch_bounds__(staged_threads<(B <= 4 ? 0 : 1)>(), staged_blocks<(B <= 4 ? 0 : 1)>()) staged_probe(
    const long long* __restrict__ desc, StagedWork w, const int* __restrict__ sorted_slot, int top_k,
    const u16* __restrict__ x, const u16* lut_s, int lut_stride, const __grid_constant__ StagedTensorMap act_map) {
    if constexpr (APL_STAGED_REGS && staged_blocks<(B <= 4 ? 0 : 1)>() == 2) set_warpgroup_registers<StagedRegs<NT8>::producer>();
    staged_produce<B, MODE, BF16, V4, NT8, APL_STAGED_PLANE_ASYNC && (B <= 4 || APL_STAGED_PLANE_ASYNC_LUT), staged_tma<(B <= 4 ? 0 : 1)>(), staged_producers<(B <= 4 ? 0 : 1)>()>(
        load_block(desc, 0), w, sorted_slot, top_k, x, lut_s, lut_stride, act_map);
}
"""


def resources(instance: str, workdir: Path) -> dict:
    """ptxas's registers and spill bytes of one apl_staged instance."""
    _, lines = sass_mix.build_instance(instance, {}, workdir)
    registers, spilled = sass_mix.resource_usage(lines)
    return {"instance": instance, "registers": registers, "spill_bytes": spilled}


def producer_loop(bits: int, mode: int, flag: str, v4: str, nt8: int, workdir: Path) -> dict:
    """The producer step loop of one width, from the probe: instructions per weight, its mix,
    and the probe's spills."""
    args = f"{bits}, {mode}, {flag}, {v4}, {nt8}"
    source = sass_mix.module_text(True) + PROBE + f"template __global__ void staged_probe<{args}>({PROBE_PARAMS});\n"
    cubin, lines = sass_mix.build_source(source, True, sass_mix.kernel_defines({}), workdir)
    _, spilled = sass_mix.resource_usage(lines)
    (loop,) = sass_mix.producer_loop_mixes(sass_mix.disassemble(cubin))
    return {"bits": bits, "mode": mode, "v4": v4 == "true", "nt8": nt8, "per_weight": loop["per_weight"],
            "alu_per_weight": loop["alu_per_weight"], "instructions": loop["instructions"],
            "sts128": loop["sts128"], "probe_spill_bytes": spilled, "mix": dict(list(loop["mix"].items())[:10])}


def tool_versions() -> dict:
    """The last line of `nvcc --version` and `nvdisasm --version` (the counts depend on both)."""
    out = {}
    for name, exe in (("nvcc", "nvcc"), ("nvdisasm", sass_mix.nvdisasm_path())):
        try:
            text = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
            out[name] = text.strip().splitlines()[-1]
        except (OSError, subprocess.CalledProcessError):
            out[name] = "unknown"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out", default="staged_sass", help="bench/results/<OUT>.json")
    args = parser.parse_args(argv)
    if not shutil.which("nvcc"):
        print("staged_sass: nvcc not found on PATH", file=sys.stderr)
        return 2
    flag = "true" if args.dtype == "bf16" else "false"
    op, _ = sass_mix._kernels()
    names = op.staged_instances(flag)
    # the producer loops the layer calls take: gate_up, 16-byte plane loads, every pass width per width
    probes = [(bits, 0, flag, "true", nt8) for bits in range(3, 9) for nt8 in op.staged_choices(0 if bits <= 4 else 1)
              if nt8 > 1]
    total, kernels, loops = len(names) + len(probes), [], []
    with tempfile.TemporaryDirectory() as tmp:
        try:  # a compile or disassembly failure: one line, exit 2
            for name in names:
                kernels.append(resources(name, Path(tmp)))
                print(f"[{len(kernels)}/{total}] {name}: {kernels[-1]['registers']} registers, "
                      f"{kernels[-1]['spill_bytes']} B spilled", file=sys.stderr, flush=True)
            for probe in probes:
                loops.append(producer_loop(*probe, Path(tmp)))
                print(f"[{len(kernels) + len(loops)}/{total}] producer {probe[0]} bits, NT8 {probe[4]}: "
                      f"{loops[-1]['per_weight']:.2f} instructions / weight, probe spills "
                      f"{loops[-1]['probe_spill_bytes']} B", file=sys.stderr, flush=True)
        except Exception as err:
            print(f"staged_sass: {err}", file=sys.stderr)
            return 2
    path = write_result(args.out, {"dtype": args.dtype, "tools": tool_versions(), "instances": kernels,
                                   "producer_loops": loops, "kernel_defines_env": os.environ.get("APL_KERNEL_DEFINES", ""),
                                   "command": "python -m bench.staged_sass " + " ".join(argv or sys.argv[1:])})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
