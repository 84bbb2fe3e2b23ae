"""The LUT refit's product arithmetic (lut_refit.PRODUCTS) against float64 on a shared model.

For every (layer, module, expert) of a shared model, the default quantiser's rows (error
feedback + LUT refit) under the calibration Hessians, with the refit's H S^T in each
product; the planes must be identical (the refit does not touch codes) and the fp16 LUTs
are compared with the float64 product's: the fraction of entries that differ and the
largest difference in fp16 steps (ulps of the float64 entry). Hessians as in
bench/quantize_gptq_probe.py. On the CPU the bfloat16 terms are multiplied in float32 (the
same values the tensor cores multiply; bench/quantize_parts.py times them on the GPU).

    .venv/bin/python -m bench.quantize_refit_product --model tiny-qwen-moe --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from bench.bench_meta import write_result
from bench.quantize_gptq_probe import probe_inputs
from pagedweight.format.apl_format import MODULES
from pagedweight.offline.apl_quantizer import QuantizerConfig, quantize_rows
from pagedweight.offline.error_feedback import feedback_factors
from pagedweight.offline.lut_refit import PRODUCTS


def fp16_steps(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|a - ref| in units of the fp16 spacing just above |ref| (both fp16; subnormals'
    spacing 2^-24 near zero)."""
    mag = ref.abs()
    step = torch.nextafter(mag, torch.full_like(mag, torch.inf)).float() - mag.float()
    return (a.float() - ref.float()).abs() / step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-moe")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens per bundled file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=None, help="the first N experts of each layer")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers, h_calib, _ = probe_inputs(args.model, args.tokens)
    base = QuantizerConfig()
    stats = {p: {"lut_entries": 0, "lut_entries_differing": 0, "max_fp16_steps": 0.0, "planes_identical": True,
                 "seconds": 0.0} for p in PRODUCTS}
    blocks = 0
    for layer in range(layers.config.num_layers):
        dense = layers.decoder_layer(layer).moe.experts
        for module in MODULES:
            for e in range(args.experts or dense.num_experts):
                w = getattr(dense, module)[e].detach().float()
                h = h_calib[layer][module][e].float()
                fb = feedback_factors(h[None], base.feedback_damp)
                out = {}
                for p in PRODUCTS:
                    started = time.perf_counter()
                    out[p] = quantize_rows(w, h.diagonal(), dataclasses.replace(base, lut_refit_product=p), fb, h[None])
                    stats[p]["seconds"] += time.perf_counter() - started
                ref = out["float64"]
                for p in PRODUCTS:
                    s = stats[p]
                    s["planes_identical"] &= bool(torch.equal(out[p].codes, ref.codes))
                    for b in base.lut_refit_bits:
                        s["lut_entries"] += ref.luts[b].numel()
                        s["lut_entries_differing"] += int((out[p].luts[b] != ref.luts[b]).sum())
                        s["max_fp16_steps"] = max(s["max_fp16_steps"], float(fp16_steps(out[p].luts[b], ref.luts[b]).max()))
                blocks += 1
        print(f"layer {layer}: {blocks} blocks", file=sys.stderr, flush=True)
    for s in stats.values():
        s["fraction_differing"] = s["lut_entries_differing"] / max(1, s["lut_entries"])
    result = {"model": args.model, "tokens_per_file": args.tokens, "blocks": blocks,
              "refit_bits": list(base.lut_refit_bits), "products": stats}
    write_result(f"quantize_refit_product_{args.model}", result)
    for p, s in stats.items():
        print(f"{p:8s} planes identical {s['planes_identical']}, LUT entries differing "
              f"{s['lut_entries_differing']}/{s['lut_entries']} ({100 * s['fraction_differing']:.3f} %), "
              f"max {s['max_fp16_steps']:.1f} fp16 steps, {s['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
