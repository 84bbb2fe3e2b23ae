"""The default quantiser's parts at a real shape: one layer's expert stacks, timed.

For each expert stack (module) of one decoder layer of a real-shape config (random weights,
and full input Hessians from random correlated inputs: the costs depend on the shapes, not
the values), `layer_quantize.quantize_experts` with
  - the k-means-only quantiser (the default before issue 14's quality round),
  - the default with the error feedback run per k-means tile (feedback_elements = the tile:
    how it ran before this change),
  - the default with the feedback over groups of experts (DEFAULT_FEEDBACK_ELEMENTS),
  - the default with each refit product (lut_refit.PRODUCTS),
each timed (synchronised, after a warm-up of the same stack cut to one expert) with its peak
device memory; the grouped run must give the per-tile run's planes and LUTs bit for bit, and
each product's LUTs are compared with float64's (fraction differing, largest difference in
fp16 steps). Then the parts of one feedback group (factors, seed k-means, feedback, splits,
refit) one by one.

    python3 -m bench.quantize_parts --model Qwen1.5-MoE-A2.7B --experts 60 --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from bench.bench_meta import write_result
from bench.quantize_refit_product import fp16_steps
from bench.real_shape_configs import REAL_SHAPE_CONFIGS
from pagedweight.format.apl_format import BIT_WIDTHS, MAX_BITS, MIN_BITS
from pagedweight.offline.apl_quantizer import (KMEANS_ONLY, QuantizerConfig, _split_clusters, row_importance,
                                               seed_centroids)
from pagedweight.offline.error_feedback import feedback_codes, feedback_factors
from pagedweight.offline.layer_quantize import DEFAULT_FEEDBACK_ELEMENTS, DEFAULT_TILE_ELEMENTS, quantize_experts
from pagedweight.offline.lut_refit import PRODUCTS, refit_luts


def stacks(name: str, experts: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cfg = REAL_SHAPE_CONFIGS[name]
    hidden = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    out = {}
    for module, (rows, cols) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        w = (torch.randn(experts, rows, cols, generator=gen) * 0.02).to(torch.bfloat16)
        out[module] = (w, cols)
    return out


def hessians(experts: int, cols: int, device: torch.device) -> torch.Tensor:
    """[E, C, C] float32 on the device: x^T x / n of inputs mixed to correlate the columns."""
    gen = torch.Generator(device).manual_seed(1)
    out = torch.empty(experts, cols, cols, device=device)
    for e in range(experts):
        mix = torch.randn(cols, cols, generator=gen, device=device) * (1.6 / cols ** 0.5) + torch.eye(cols, device=device)
        x = torch.randn(2 * cols, cols, generator=gen, device=device) @ mix
        out[e] = x.T @ x / (2 * cols)
    return out


def timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    return out, seconds, peak


def same(a, b) -> bool:
    return bool(torch.equal(a.planes.planes, b.planes.planes)) and all(
        torch.equal(a.planes.luts[x], b.planes.luts[x]) for x in BIT_WIDTHS)


def parts(w, h_full, config, device, tile_elements):
    """One feedback group's parts, each synchronised: seconds per part."""
    E, R, C = w.shape
    t = {}
    rows = w.to(device, torch.float32)
    u, t["factors"], _ = timed(device, lambda: feedback_factors(h_full, config.feedback_damp))
    flat = rows.reshape(E * R, C)
    imp = row_importance(flat, h_full.diagonal(dim1=1, dim2=2)[:, None, :].expand(E, R, C).reshape(E * R, C), config)
    cent, t["seed_kmeans"], _ = timed(device, lambda: seed_centroids(flat, imp, config))
    codes, t["feedback"], _ = timed(device, lambda: feedback_codes(rows, u, cent.view(E, R, -1)).view(E * R, C).long())
    # the splits and the refit run per k-means tile in quantize_experts; here over the first tile
    n = max(1, min(E, tile_elements // (R * C)))
    sub = slice(0, n * R)

    def splits():
        c, ce, luts = codes[sub], cent[sub], {MIN_BITS: cent[sub]}
        for b in range(MIN_BITS, MAX_BITS):
            c, ce = _split_clusters(flat[sub], imp[sub], c, ce, config.split_iters)
            luts[b + 1] = ce
        return c, luts
    (c8, luts), t["splits_one_tile"], _ = timed(device, splits)
    for p in PRODUCTS:
        _, t[f"refit_{p}_one_tile"], _ = timed(device, lambda: refit_luts(
            flat[sub], c8, luts, h_full[:n], config.lut_ridge, config.lut_refit_bits, p))
    t["tile_experts"] = n
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen1.5-MoE-A2.7B", choices=list(REAL_SHAPE_CONFIGS))
    parser.add_argument("--experts", type=int, default=None, help="experts of the stack (default: the config's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip", nargs="*", default=[], help="runs to leave out (kmeans_only, per_tile, ...)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--copy-to", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = REAL_SHAPE_CONFIGS[args.model]
    E = args.experts or cfg.get("num_experts") or cfg["num_local_experts"]
    gen = torch.Generator().manual_seed(0)
    default = QuantizerConfig()
    runs = {"kmeans_only": (KMEANS_ONLY, DEFAULT_FEEDBACK_ELEMENTS),
            "default_per_tile_feedback": (default, DEFAULT_TILE_ELEMENTS),
            **{f"default_grouped_{p}": (dataclasses.replace(default, lut_refit_product=p), DEFAULT_FEEDBACK_ELEMENTS)
               for p in PRODUCTS}}
    result = {"model": args.model, "experts": E, "device": str(device), "tile_elements": DEFAULT_TILE_ELEMENTS,
              "feedback_elements": DEFAULT_FEEDBACK_ELEMENTS, "modules": {}}
    for module, (w, C) in stacks(args.model, E, gen).items():
        h_full = hessians(E, C, device)
        h = h_full.diagonal(dim1=1, dim2=2).cpu()
        rec = {"shape": list(w.shape)}
        quantize_experts(w[:1, :64], h[:1], default, str(device), h_full=h_full[:1])  # warm-up
        out = {}
        for name, (config, fb) in runs.items():
            if name in args.skip:
                continue
            out[name], s, peak = timed(device, lambda: quantize_experts(
                w, h, config, str(device), h_full=h_full, feedback_elements=fb))
            rec[name] = {"seconds": s, "peak_device_bytes_above_inputs": peak}
            print(f"{module} {name}: {s:.2f} s, peak {(peak or 0) / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        if "default_per_tile_feedback" in out:
            rec["grouped_equals_per_tile"] = same(out["default_grouped_float64"], out["default_per_tile_feedback"])
        ref = out["default_grouped_float64"]
        for p in PRODUCTS:
            if f"default_grouped_{p}" not in out:
                continue
            o = out[f"default_grouped_{p}"]
            rec[f"default_grouped_{p}"].update({
                "planes_identical_to_float64": bool(torch.equal(o.planes.planes, ref.planes.planes)),
                "lut_fraction_differing": sum(int((o.planes.luts[b] != ref.planes.luts[b]).sum()) for b in default.lut_refit_bits)
                / sum(ref.planes.luts[b].numel() for b in default.lut_refit_bits),
                "lut_max_fp16_steps": max(float(fp16_steps(o.planes.luts[b], ref.planes.luts[b]).max())
                                          for b in default.lut_refit_bits)})
        del out
        fb_experts = max(1, min(E, DEFAULT_FEEDBACK_ELEMENTS // (w.shape[1] * C)))
        rec["parts_one_feedback_group"] = parts(w[:fb_experts], h_full[:fb_experts], default, device, DEFAULT_TILE_ELEMENTS)
        rec["parts_one_feedback_group"]["group_experts"] = fb_experts
        print(module, rec["parts_one_feedback_group"], file=sys.stderr, flush=True)
        result["modules"][module] = rec
        del h_full
    name = args.name or f"quantize_parts_{args.model}"
    path = write_result(name, result)
    if args.copy_to:
        import shutil
        shutil.copyfile(path, f"{args.copy_to}/{path.name}")
    for module, rec in result["modules"].items():
        print(module, {k: (round(v["seconds"], 2) if isinstance(v, dict) and "seconds" in v else v)
                       for k, v in rec.items() if k != "parts_one_feedback_group"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
