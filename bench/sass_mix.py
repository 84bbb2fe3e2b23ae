"""The instruction mix per weight of the decode kernel's step loops, read from its SASS
(docs/kernel.md, "Instruction counts"): one `apl_gemv` instance compiled by nvcc as the host
builds it (its defines, plus NAME=VALUE overrides), disassembled by nvdisasm; the innermost loops
holding HMMA or HGMMA, opcodes counted per weight. An m16n8k16 A fragment is 8 weights a thread:
weights = 8 x HMMA (decode), 8 x HMMA / NT8 (tiles: a fragment feeds NT8 mma), 8 x HGMMA
(wgmma m64nNk16: 64 x 16 weights over 128 threads); of an `apl_staged` instance, the
consumer's HGMMA loops. Needs nvcc (CUDA 12.4+ for sm_90) and nvdisasm on PATH or in NVDISASM;
no GPU.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_meta import arg_parser, write_result
from pagedweight_kernels import compile as op
from pagedweight_kernels.cuda_packages import module_source

GEMV_PARAMS = ("const long long* __restrict__, const long long* __restrict__, int, int, int, const u16* __restrict__, "
               "int, int, int, int, int, float* __restrict__, int* __restrict__, u16* __restrict__, "
               "const void* __restrict__, int, int, u16* __restrict__, int")
STAGED_PARAMS = ("const long long* __restrict__, const int* __restrict__, const int* __restrict__, "
                 "const int* __restrict__, int, const u16* __restrict__, int, int, int, u16* __restrict__, "
                 "float* __restrict__, int, const __grid_constant__ StagedTensorMap")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")
_INSTANCE = re.compile(r"apl_gemv<\d, \d, (true|false), (true|false), \d+(, (true|false))?>"
                       r"|apl_staged<\d, \d, (true|false), (true|false), \d+>")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def loops(sass: str) -> list[tuple[int, int]]:
    """(first line, last line) of every backward branch's body."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    out = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            out.append((labels[m.group(1)], i))
    return out


def step_loop_mixes(sass: str, tiles: int = 1) -> list[dict]:
    """Per innermost loop holding HMMA or HGMMA: instructions, mma, weights and opcodes per
    weight (tiles: the instance's NT8, the mma.sync each A fragment feeds)."""
    lines = sass.splitlines()
    spans = [(a, b) for a, b in loops(sass) if any("HMMA" in line or "HGMMA" in line for line in lines[a:b + 1])]
    out = []
    for a, b in spans:
        if any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2 in spans):
            continue  # it holds an inner one
        ops = [m.group(1) for line in lines[a:b + 1] if (m := _OPCODE.search(line))]
        hmma, hgmma = sum(op.startswith("HMMA") for op in ops), sum(op.startswith("HGMMA") for op in ops)
        weights = 8 * hgmma + 8 * hmma / tiles
        counts = collections.Counter(op.split(".")[0] for op in ops)
        out.append({"first_line": a, "instructions": len(ops), "hmma": hmma, "hgmma": hgmma,
                    "per_weight": round(len(ops) / weights, 4),
                    "alu_per_weight": round(sum(counts[o] for o in ("PRMT", "LOP3", "SHF")) / weights, 4),
                    "mix": {op: round(n / weights, 4) for op, n in counts.most_common()}})
    return out


def build_instance(instance: str, overrides: dict[str, int], workdir: Path) -> tuple[Path, str]:
    """(cubin, ptxas resource lines) of one apl_gemv or apl_staged instance, compiled by nvcc as
    the host would: its defines, for sm_90a (wgmma) where the host builds it so, else sm_90."""
    staged = instance.startswith("apl_staged<")
    params = STAGED_PARAMS if staged else GEMV_PARAMS
    (workdir / "k.cu").write_text(module_text(staged) + f"\ntemplate __global__ void {instance}({params});\n")
    cubin = workdir / "k.cubin"
    arch = "-gencode=arch=compute_90a,code=sm_90a" if op.wgmma_build(instance) else "-arch=sm_90"
    build = subprocess.run(["nvcc", "-std=c++17", arch, "-cubin", "-o", str(cubin), str(workdir / "k.cu"), "-Xptxas",
                            "-v", *(f"-D{k}={v}" for k, v in kernel_defines(overrides).items())],
                           capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(build.stderr[-4000:])
    resources = "\n".join(line.strip() for line in build.stderr.splitlines() if "registers" in line or "spill" in line)
    return cubin, resources


def kernel_defines(overrides: dict[str, int]) -> dict[str, int]:
    """The host's compile defines (DEFAULT_CONFIG's, SiLU), with overrides."""
    return {**dict(op.DEFAULT_CONFIG.defines("silu")), **overrides}


def module_text(staged: bool) -> str:
    """The NVRTC module's source as the host builds it: apl_moe.cu and apl_gemv.cu, and
    apl_staged.cu after them where staged."""
    return module_source(op.SOURCE, op.GEMV_SOURCE, op.PREFILL_SOURCE, *([op.STAGED_SOURCE] if staged else []))


def disassemble(cubin: Path) -> str:
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or "nvdisasm"
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def refuse(message: str) -> int:
    print(f"sass_mix: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("instance", nargs="?", default="apl_gemv<0, 0, true, true, 1>")
    parser.add_argument("defines", nargs="*", help="NAME=VALUE overrides of the default defines")
    args = parser.parse_args(argv)
    try:
        overrides = {k: int(v) for k, _, v in (d.partition("=") for d in args.defines)}
    except ValueError:
        return refuse(f"defines must be NAME=integer, got {args.defines}")
    if not _INSTANCE.fullmatch(args.instance):
        return refuse("the instance must read apl_gemv<CLS, MODE, true|false, true|false, NT8> or apl_staged<...> "
                      f"with the same arguments, got {args.instance!r}")
    if not shutil.which("nvcc"):
        return refuse("nvcc not found on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cubin, resources = build_instance(args.instance, overrides, Path(tmp))
            sass = disassemble(cubin)
        except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as err:
            return refuse(str(err))
    print(resources)
    mixes = step_loop_mixes(sass, op.instance_tiles(args.instance))
    for m in mixes:
        print(f"loop @{m['first_line']}: {m['instructions']} instructions, HMMA {m['hmma']}, HGMMA {m['hgmma']}: "
              f"{m['per_weight']:.3f} / weight (PRMT+LOP3+SHF {m['alu_per_weight']:.3f}) | "
              + "  ".join(f"{k} {v:.3f}" for k, v in list(m["mix"].items())[:12]))
    print(write_result("sass_mix", {"instance": args.instance, "overrides": overrides, "resources": resources,
                                   "loops": mixes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
