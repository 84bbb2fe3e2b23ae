"""Shared-memory bank conflicts of the staged regime's producers, counted on the CPU: one launch
per width (and the plane ring) run by bench/staged_host's harness with APL_HOST_BANKS set, which
logs every thread's LSU accesses (the A tiles' STS.128, the activations' and plane words' cp.async,
the plane ring's LDS.128) and counts, per warp instruction, the
wavefronts 32 banks of 4 bytes take (the most distinct words one bank is asked for, at least one
per 128 bytes) against the fewest its bytes allow.

Usage: python -m bench.staged_banks [--out NAME]   (nvcc, no GPU; bench/results/<NAME>.json)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from bench.bench_meta import write_result
from bench.sass_mix import kernel_defines
from bench.staged_host import build_harness, planned, projection_case, run_launch
from pagedweight_kernels import apl_moe as op

# (name, bits per expert, define overrides, merged): down, 128 rows, 512 columns, 80 tokens x top-2
# over 4 experts (64-token passes), so each width's producers run 8 steps a pass; merged: the merged
# class's launch
CASES = [("3 bits", 3, {}, False), ("4 bits", 4, {}, False), ("4 bits, plane ring", 4, {"APL_STAGED_PLANE_ASYNC": 1}, False),
         ("5 bits", 5, {}, False), ("6 bits", 6, {}, False), ("7 bits", 7, {}, False), ("8 bits", 8, {}, False),
         ("5 bits, merged launch", 5, {}, True)]


def count(name: str, bits: int, overrides: dict[str, int], merged: bool, work: Path) -> dict:
    """One launch's bank counts per instruction kind (kinds it never issued left out)."""
    case = projection_case(1, [bits] * 4, 128, 512, 80, 2, torch.bfloat16, seed=1)
    config = op.DEFAULT_CONFIG.with_knobs(**overrides)
    instance, plan, lut_bits = planned(case, config)
    if merged:
        instance, lut_bits = (2, *instance[1:]), 8
        plan = op.staged_plan(1, 80, 2, 4, 128, 2, lut_bits, 4, instance[3], config)
    harness = build_harness(work, kernel_defines(overrides), instance)
    banks = work / "banks.json"
    run = run_launch(harness, work, case, plan, lut_bits, env={**os.environ, "APL_HOST_BANKS": str(banks)})
    if run.returncode:
        raise RuntimeError(f"{name}: the harness failed: {run.stderr[-500:]}")
    kinds = {kind: {**c, "wavefronts_per_instruction": round(c["wavefronts"] / c["instructions"], 3),
                    "ideal_per_instruction": round(c["ideal"] / c["instructions"], 3)}
             for kind, c in json.loads(banks.read_text()).items() if c["instructions"]}
    return {"case": name, "bits": bits, "overrides": overrides, "instance": list(instance), "lut_bits": lut_bits,
            "kinds": kinds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="staged_banks", help="bench/results/<OUT>.json")
    args = parser.parse_args(argv)
    if not shutil.which("nvcc"):
        print("staged_banks: nvcc not found on PATH", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        try:  # a build or run failure: one line, exit 2
            for i, (name, bits, overrides, merged) in enumerate(CASES):
                results.append(count(name, bits, overrides, merged, Path(tmp)))
                summary = ", ".join(f"{k} {v['wavefronts_per_instruction']:.2f}/{v['ideal_per_instruction']:.2f}"
                                    for k, v in results[-1]["kinds"].items())
                print(f"[{i + 1}/{len(CASES)}] {name}: {summary}", file=sys.stderr, flush=True)
        except (RuntimeError, OSError) as err:
            print(f"staged_banks: {err}", file=sys.stderr)
            return 2
    path = write_result(args.out, {"cases": results, "wavefronts": "per warp instruction: counted / fewest possible",
                                   "command": "python -m bench.staged_banks " + " ".join(argv or sys.argv[1:])})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
