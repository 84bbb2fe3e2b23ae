"""Results from the log of a device call whose benches were cut off before writing JSON.

bench/quantize_quality14_device.sh's call (2026-12-01) ran past its deadlines: the
4-layer quantisation finished its 10 steps but was stopped in the assembly, and the parts
bench printed its timings but not its JSON. This reads what the log and the memory samples
hold (the progress bar's elapsed seconds per step, the parts' printed seconds and peaks)
into bench/results/NAME.json; nothing is estimated here.

    python3 -m bench.quantize_device_log --log bench/results/quantize_quality14_device.log \
        --samples bench/results/quantize_full_depth_qwen_4l_new_default.samples.jsonl --commit a12d75d
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from bench.bench_meta import RESULTS_DIR

STEP = re.compile(r"(\d+)/(\d+) steps \| (.+?) \| blocks .*? \| (\d+):(\d+) elapsed")
PART = re.compile(r"^(gate_up|down) (\w+): ([\d.]+) s, peak ([\d.]+) GiB$")


def parse(log: str) -> dict:
    steps, section, parts, breakdown = [], "full_depth", {}, {}
    for line in log.splitlines():
        for m in STEP.finditer(line):
            steps.append({"step": int(m[1]), "name": m[3], "elapsed_s": int(m[4]) * 60 + int(m[5])})
        if line.startswith("full depth rc="):
            section = "Qwen1.5-MoE-A2.7B"
        elif line.startswith("parts qwen rc="):
            section = "Mixtral-8x7B"
        m = PART.match(line.strip())
        if m:
            parts.setdefault(section, {}).setdefault(m[1], {})[m[2]] = {"seconds": float(m[3]), "peak_gib_above_inputs": float(m[4])}
        elif re.match(r"^(gate_up|down) \{", line):
            module, _, rest = line.partition(" ")
            breakdown.setdefault(section, {})[module] = ast.literal_eval(rest)
    return {"progress_steps": steps, "parts_seconds": parts, "parts_one_feedback_group": breakdown}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--commit", required=True, help="the commit the call ran")
    parser.add_argument("--date", default="2026-12-01")
    parser.add_argument("--name", default="quantize_quality14_device")
    args = parser.parse_args(argv)
    log = Path(args.log).read_text()
    samples = [json.loads(s) for s in Path(args.samples).read_text().splitlines() if s.strip()]
    gpu = next((line.split(",")[0] for line in log.splitlines() if line.startswith("NVIDIA")), None)
    rcs = dict(re.findall(r"^(full depth|parts qwen|parts mixtral) rc=(\d+)$", log, re.M))
    out = {"benchmark": args.name, "date": args.date, "machine": {"gpu": gpu, "cpu_count": 16},
           "commit": args.commit, "source": {"log": args.log, "samples": args.samples},
           "exit_codes": rcs, **parse(log),
           "samples": {"count": len(samples), "period_s": 2.0,
                       **{f"peak_{k}_bytes_sampled": max(s[k] for s in samples)
                          for k in ("VmRSS", "RssAnon", "RssShmem", "device_allocated")}}}
    path = RESULTS_DIR / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
