"""Tuning runs: the fused layer call under compile-time variants of the kernels (one GPU call).

Times a few decode and prefill shapes (bench/apl_moe_kernel.py's method: layer copies,
fresh routing per call, CUDA-graph replays) for each variant of kernels.apl_moe.KERNEL_DEFINES
and prefill tile choice; prints one line per (variant, shape). Used to pick the defaults;
results are recorded in docs/kernel.md.

Usage on the GPU machine: PYTHONPATH=.:services:kernels python3 bench/apl_moe_variants.py
"""

import sys

import torch

import pagedweight_kernels.apl_moe as op
from bench.apl_moe_kernel import COPIES, MODELS, REPS, SyntheticLayer, bit_assignment, routings, time_calls

SHAPES = [("mixtral-8x7b", 1, "4"), ("mixtral-8x7b", 1, "8"), ("mixtral-8x7b", 4, "4"),
          ("qwen1.5-moe-a2.7b", 1, "4"), ("qwen1.5-moe-a2.7b", 16, "4")]
PREFILL_SHAPES = [("mixtral-8x7b", 256, "4"), ("mixtral-8x7b", 16, "4"), ("qwen1.5-moe-a2.7b", 64, "4"),
                  ("qwen1.5-moe-a2.7b", 256, "4")]
BASE = dict(op.KERNEL_DEFINES)
VARIANTS = {
    "base": {},
    "umulhi": {"APL_SHIFT_MODE": 1},
    "lds_cxx": {"APL_LDS_MODE": 0},
    "rpg2": {"APL_RPG_DIV": 16},
    "nopf": {"APL_PREFETCH": 0},
    "umulhi_rpg2_nopf_3blk": {"APL_SHIFT_MODE": 1, "APL_RPG_DIV": 16, "APL_PREFETCH": 0, "APL_DECODE_MIN_BLOCKS": 3},
    "umulhi_nopf_3blk": {"APL_SHIFT_MODE": 1, "APL_PREFETCH": 0, "APL_DECODE_MIN_BLOCKS": 3},
}
PREFILL_VARIANTS = {  # name -> (tiles, defines)
    "base": (op.PREFILL_TILES, {}),
    "3_blocks": (op.PREFILL_TILES, {"APL_PREFILL_MIN_BLOCKS": 3}),
    "2_blocks": (op.PREFILL_TILES, {"APL_PREFILL_MIN_BLOCKS": 2}),
    "3_blocks_tiles_to_64": (((12.0, 16), (40.0, 32)), {"APL_PREFILL_MIN_BLOCKS": 3}),
}


def layer_calls(x, route, apl):
    return [lambda c=i % COPIES, i=i: op.apl_moe(x[i], *route[i], apl[c]) for i in range(REPS)]


def main():
    device = torch.device("cuda")
    layers = {name: [SyntheticLayer(*MODELS[name][:1], *MODELS[name][2:], seed, device) for seed in range(COPIES)]
              for name in MODELS}
    cases = {}
    for name, T, bits in SHAPES + PREFILL_SHAPES:
        E, k, H, I = MODELS[name]
        apl = [layer.apl(bit_assignment(bits, E, 17)) for layer in layers[name]]
        route = routings(T, E, k, REPS, device, seed=T)
        x = [torch.randn(T, H, device=device).bfloat16() for _ in range(REPS)]
        cases[(name, T, bits)] = layer_calls(x, route, apl)
    for vname, change in (VARIANTS.items() if "--decode" in sys.argv else ()):
        op.KERNEL_DEFINES.clear()
        op.KERNEL_DEFINES.update(BASE, **change)
        for shape in SHAPES:
            print(f"{vname:22s} {shape[0]:18s} T={shape[1]:3d} bits={shape[2]}  {time_calls(cases[shape]):8.1f} us", flush=True)
    op.KERNEL_DEFINES.clear()
    op.KERNEL_DEFINES.update(BASE)
    for vname, (tiles, change) in PREFILL_VARIANTS.items():
        op.PREFILL_TILES = tiles
        op.KERNEL_DEFINES.clear()
        op.KERNEL_DEFINES.update(BASE, **change)
        for shape in PREFILL_SHAPES:
            print(f"{vname:22s} {shape[0]:18s} T={shape[1]:3d} bits={shape[2]}  {time_calls(cases[shape]):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
