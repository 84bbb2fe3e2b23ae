"""SASS fingerprints of the kernel instances the host can launch, to show a source change leaves
the device code as it was (or to list the instances it changed): every bf16 apl_gemv instance of
kernel_instances, every bf16 apl_staged instance of staged_instances, and the first 6 fp16 of
each, compiled by nvcc as bench/sass_mix does and disassembled with nvdisasm; the sha256 of each
listing. No GPU.

Usage: python -m bench.sass_snapshot --out BEFORE.json            (take a snapshot)
       python -m bench.sass_snapshot --out AFTER.json --compare BEFORE.json
(nvcc and nvdisasm, NVDISASM naming it where it is not on PATH; about 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.sass_mix import build_instance, disassemble
from pagedweight_kernels import apl_moe as op


def instances() -> list[str]:
    gemv = {dtype: [n for n, _ in op.kernel_instances(dtype) if n.startswith("apl_gemv")]
            for dtype in (torch.bfloat16, torch.float16)}
    return (gemv[torch.bfloat16] + op.staged_instances("true") + gemv[torch.float16][:6]
            + op.staged_instances("false")[:6])


def fingerprint(instance: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin, _ = build_instance(instance, {}, Path(tmp))
        return hashlib.sha256(disassemble(cubin).encode()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the fingerprints go (JSON)")
    parser.add_argument("--compare", type=Path, help="an earlier snapshot: list the instances that differ")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        before = json.loads(args.compare.read_text()) if args.compare else None
    except (OSError, ValueError) as err:
        print(f"sass_snapshot: cannot read {args.compare}: {err}", file=sys.stderr)
        return 2
    if not shutil.which("nvcc"):
        print("sass_snapshot: nvcc not found on PATH", file=sys.stderr)
        return 2
    names, prints = instances(), {}
    try:
        with ThreadPoolExecutor(max(1, args.workers)) as pool:
            for i, (name, sha) in enumerate(zip(names, pool.map(fingerprint, names)), 1):
                prints[name] = sha
                print(f"[{i}/{len(names)}] {name}", file=sys.stderr, flush=True)
        args.out.write_text(json.dumps(prints, indent=1) + "\n")
    except (RuntimeError, OSError) as err:
        print(f"sass_snapshot: {err}", file=sys.stderr)
        return 2
    if before is not None:
        changed = [n for n in names if before.get(n) != prints[n]]
        print(f"{len(changed)} of {len(names)} instances differ from {args.compare}")
        for name in changed:
            print(f"  {name}{'' if name in before else ' (new)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
