"""Probe: the LUT refit's ridge (offline/lut_refit.py) against held-out block error, per width.

For every (layer, module, expert) of a shared model (or the first --experts of each layer),
the nested quantiser's codes, plain (k-means seed) and with error feedback (d = 1), then
each row's LUT at widths 3..--top-bits refitted under the calibration Hessian with each
--ridge (0 = unregularised; the bucket means are ridge -> infinity). Scored by the block
error trace((W - Q) H (W - Q)^T) summed over blocks, under H from the calibration text
(what the refit minimises) and from each domain's `valid` text (held out), relative to the
same codes with the bucket-mean LUT. Hessians as in bench/quantize_gptq_probe.py (its
layer-by-layer fp32 forward). A proxy for the model's KL, used to choose the ridge before
artifacts are made.

    .venv/bin/python -m bench.quantize_lut_ridge --model tiny-qwen-moe --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from bench.bench_meta import write_result
from bench.quantize_gptq_probe import forward, probe_inputs
from pagedweight.format.apl_format import MAX_BITS, MODULES
from pagedweight.offline.apl_quantizer import KMEANS_ONLY, quantize_rows
from pagedweight.offline.error_feedback import block_error, feedback_factors
from pagedweight.offline.lut_refit import bucket_systems, solve_ridge


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-moe")
    parser.add_argument("--tokens", type=int, default=8192, help="per file, calibration and valid each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top-bits", type=int, default=6)
    parser.add_argument("--experts", type=int, default=None, help="the first N experts of each layer")
    parser.add_argument("--ridge", type=float, nargs="+", default=[0.0, 0.01, 0.03, 0.1, 0.3, 1.0])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    layers, h_calib, valid = probe_inputs(args.model, args.tokens)
    _, h_valid = forward(layers, valid, 8, record=True)
    print(f"Hessians in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    widths = tuple(range(3, args.top_bits + 1))
    seeds = {"kmeans": KMEANS_ONLY, "feedback": dataclasses.replace(KMEANS_ONLY, error_feedback=True, feedback_damp=1.0)}
    # seed -> bits -> ridge ("means" for the bucket means) -> {"calib", "valid"} summed error
    totals = {s: {b: {r: {"calib": 0.0, "valid": 0.0} for r in ["means", *args.ridge]} for b in widths} for s in seeds}
    for layer in range(layers.config.num_layers):
        dense = layers.decoder_layer(layer).moe.experts
        for module in MODULES:
            for e in range(args.experts or dense.num_experts):
                w = getattr(dense, module)[e].detach().float()
                hc, hv = h_calib[layer][module][e], h_valid[layer][module][e]
                for seed, config in seeds.items():
                    fb = feedback_factors(hc[None], config.feedback_damp) if config.error_feedback else None
                    q = quantize_rows(w, hc.diagonal(), config, fb)
                    systems = bucket_systems(w, q.codes, hc, widths)
                    for b in widths:
                        codes = q.codes.long() >> (MAX_BITS - b)
                        means = q.luts[b].double()
                        fits = {"means": means, **{r: solve_ridge(*systems[b], means, r) for r in args.ridge}}
                        for r, lut in fits.items():
                            deq = torch.gather(lut.float().half().float(), 1, codes)
                            totals[seed][b][r]["calib"] += block_error(w, deq, hc)
                            totals[seed][b][r]["valid"] += block_error(w, deq, hv)
        print(f"layer {layer} done, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    relative = {s: {b: {str(r): {k: v / t[b]["means"][k] for k, v in e.items()} for r, e in t[b].items()}
                    for b in widths} for s, t in totals.items()}
    # the feedback seed's errors relative to plain k-means' bucket means, the table's baseline
    against_kmeans = {b: {str(r): totals["feedback"][b][r]["valid"] / totals["kmeans"][b]["means"]["valid"]
                          for r in totals["feedback"][b]} for b in widths}
    result = {"model": args.model, "tokens_per_file": args.tokens, "widths": list(widths), "ridge": args.ridge,
              "experts_per_layer": args.experts,
              "error_sum": {s: {str(b): {str(r): v for r, v in e.items()} for b, e in t.items()} for s, t in totals.items()},
              "relative_to_bucket_means": {s: {str(b): v for b, v in t.items()} for s, t in relative.items()},
              "feedback_valid_relative_to_kmeans_means": {str(b): v for b, v in against_kmeans.items()},
              "seconds": time.perf_counter() - started,
              "note": "sum over blocks of trace((W-Q) H (W-Q)^T); LUTs rounded to fp16 as stored"}
    path = write_result(f"quantize_lut_ridge_{args.model}", result)
    for s, t in relative.items():
        for b, r in t.items():
            print(s, b, {k: f"{v['valid']:.3f} (calib {v['calib']:.3f})" for k, v in r.items()})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
