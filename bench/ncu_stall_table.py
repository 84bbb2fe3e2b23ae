"""Where a kernel's warps stall, from Nsight Compute's source page (bench/kernel_stalls_gpu.sh):
per kernel in the CSV (`ncu -i REP --page source --csv --print-source sass`), the share of
warp-stall samples by reason and the SASS instructions holding the most samples.

Usage: python -m bench.ncu_stall_table FILE.csv[.gz] ... [--top N] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_kernels(path: Path) -> list[dict]:
    """[{name, rows: [{column: value}]}] for each kernel section of the CSV."""
    raw = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    kernels, header = [], None
    for row in csv.reader(io.StringIO(raw)):
        if row and row[0] == "Kernel Name":
            kernels.append({"name": row[1], "rows": []})
            header = None
        elif kernels and row:
            if header is None:
                header = row
            else:
                kernels[-1]["rows"].append(dict(zip(header, row)))
    return kernels


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(kernel: dict, top: int) -> dict:
    rows = kernel["rows"]
    reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
    totals = collections.Counter({c: sum(_number(r[c]) for r in rows) for c in reasons})
    samples = sum(totals.values()) or 1.0
    hottest = sorted(rows, key=lambda r: -_number(r[SAMPLES]))[:top]
    return {
        "kernel": kernel["name"].split(">(")[0] + ">",  # the template arguments, not the parameters
        "samples": int(samples),
        "instructions_executed": int(sum(_number(r["Instructions Executed"]) for r in rows)),
        "reasons": {c.removeprefix("stall_"): round(v / samples, 4) for c, v in totals.most_common() if v},
        "hottest": [{"sass": r["Source"].strip(), "share": round(_number(r[SAMPLES]) / samples, 4),
                     "reason": max(reasons, key=lambda c: _number(r[c])).removeprefix("stall_")}
                    for r in hottest],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    out = {}
    for path in args.files:
        if not path.is_file():
            print(f"ncu_stall_table: {path}: no such file", file=sys.stderr)
            return 2
        out[path.name] = [summarise(k, args.top) for k in read_kernels(path)]
        for s in out[path.name]:
            print(f"{path.name} {s['kernel']}: {s['samples']} samples; "
                  + ", ".join(f"{k} {v:.1%}" for k, v in list(s["reasons"].items())[:7]))
            for h in s["hottest"]:
                print(f"    {h['share']:6.1%} {h['reason']:13s} {h['sass']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
