"""What streaming in bf16 (the default on a GPU for a bf16 checkpoint) changes against
fp32 (the default on the CPU, bit-equal to the whole-model quantiser): one shared model
quantised both ways on the CPU, same calibration, then
- the fraction of weights whose 8-bit APL code is the same (k-means sees h from bf16
  statistics, so a centroid boundary can move),
- the relative difference of every block's S(b) and S_gn(b) (median, 99th percentile, max),
- the Spearman rank correlation across blocks of the planner's signal S_gn(3) - S_gn(8),
  which is what orders blocks for bits.

    .venv/bin/python -m bench.quantize_stream_dtype --model tiny-qwen-moe
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.bench_meta import write_result
from pagedweight.common.paths import shared_models_dir
from pagedweight.format.apl_format import unpack_codes
from pagedweight.format.paged_model import load_paged_model
from pagedweight.offline.calib_text import bundled_calib_files
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model


def ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values)
    out = np.empty(len(values))
    out[order] = np.arange(len(values))
    return out


def table_diff(a: dict, b: dict) -> dict:
    rel = np.array([abs(b[k][bits] - v) / max(abs(v), 1e-30) for k, row in a.items() for bits, v in row.items()])
    drop_a = np.array([row["3"] - row["8"] for row in a.values()])
    drop_b = np.array([b[k]["3"] - b[k]["8"] for k in a])
    spearman = float(np.corrcoef(ranks(drop_a), ranks(drop_b))[0, 1])
    return {"rel_diff_median": float(np.median(rel)), "rel_diff_p99": float(np.quantile(rel, 0.99)),
            "rel_diff_max": float(rel.max()), "spearman_drop_3_to_8": spearman}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-moe", help="a model in ../shared/models")
    parser.add_argument("--calib-tokens", type=int, default=2048, help="tokens per bundled calibration file")
    args = parser.parse_args(argv)
    model_dir = shared_models_dir() / args.model
    base = replace(QuantizeConfig(), scale_tokens=0, calib=CalibConfig(max_tokens_per_file=args.calib_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        paged = {}
        for dtype in ("float32", "bfloat16"):
            print(f"quantising {args.model} in {dtype}", file=sys.stderr, flush=True)
            out = quantize_model(model_dir, Path(tmp) / dtype, bundled_calib_files(), replace(base, dtype=dtype),
                                 progress=sys.stderr)
            paged[dtype] = load_paged_model(out, with_bf16=False)
        a, b = paged["float32"], paged["bfloat16"]
        same = total = 0
        for key, planes in a.apl.items():
            for e in range(planes.planes.shape[0]):
                ca = unpack_codes(planes.planes[e], 8)
                cb = unpack_codes(b.apl[key].planes[e], 8)
                same += int((ca == cb).sum())
                total += ca.numel()
        result = {
            "model": args.model, "device": "cpu",
            "calibration": {"files": len(bundled_calib_files()), "tokens_per_file": args.calib_tokens},
            "codes_equal_fraction": same / total,
            "sensitivity": table_diff(a.meta["sensitivity"], b.meta["sensitivity"]),
            "sensitivity_gn": table_diff(a.meta["sensitivity_gn"], b.meta["sensitivity_gn"]),
            "seconds": {d: p.meta["quantizer"]["streaming"]["seconds_total"] for d, p in paged.items()},
        }
    path = write_result(f"quantize_stream_dtype_{args.model}", result)
    print(path)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
