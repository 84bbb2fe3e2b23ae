"""What stable decode launches cost the fused kernel, on the GPU.

A pager's layers decode through the merged kernel at the 8-bit LUT size whatever their
widths (`APLLayer.stable_launches`), so a bit change never makes a decode graph capture
again. This times one Qwen1.5-MoE layer at decode batch sizes (1, 32, 48, 64 tokens) with
the launches that follow the layer's bit classes and with the stable ones, at uniform 8, 4
and mixed widths; same method as bench/apl_moe_kernel.py (several weight copies, a fresh
routing per call, a CUDA graph of the calls replayed, median of trials).

    PYTHONPATH=.:services:kernels python3 -m bench.stable_launches
"""

from __future__ import annotations

import argparse

import torch

from bench.apl_moe_kernel import COPIES, MODELS, REPS, SyntheticLayer, bit_assignment, routings, time_calls
from bench.bench_meta import write_result
from pagedweight_kernels.apl_moe import APLLayer, apl_moe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 48, 64])
    parser.add_argument("--bits", nargs="+", default=["8", "4", "mixed"])
    parser.add_argument("--name", default="stable_launches")
    args = parser.parse_args()
    device = torch.device("cuda")
    E, k, H, I = MODELS["qwen1.5-moe-a2.7b"]
    layers = [SyntheticLayer(E, H, I, seed, device) for seed in range(COPIES)]
    rows = []
    for config in args.bits:
        classed = [layer.apl(bit_assignment(config, E, 17)) for layer in layers]
        stable = [APLLayer(x.gate_up, x.down, x.activation, stable_launches=True) for x in classed]
        for T in args.tokens:
            route = routings(T, E, k, REPS, device, seed=T)
            x = [torch.randn(T, H, device=device).bfloat16() for _ in range(REPS)]
            pairs = [(i % COPIES, i) for i in range(REPS)]
            same = all(torch.equal(apl_moe(x[i], *route[i], classed[c]), apl_moe(x[i], *route[i], stable[c]))
                       for c, i in pairs)
            us = {name: time_calls([lambda c=c, i=i: apl_moe(x[i], *route[i], ops[c]) for c, i in pairs])
                  for name, ops in (("class_launches_us", classed), ("stable_us", stable))}
            row = {"bits": config, "tokens": T, **us, "stable_over_class": us["stable_us"] / us["class_launches_us"],
                   "outputs_equal": same, "class_launches": classed[0].decode_launches("gate_up")}
            rows.append(row)
            print(f"bits={config:5s} T={T:3d} class {us['class_launches_us']:8.1f} us  stable {us['stable_us']:8.1f} us "
                  f"({row['stable_over_class']:.3f}x)  outputs equal {same}", flush=True)
    path = write_result(args.name, {"model": "qwen1.5-moe-a2.7b layer", "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
