"""Tuning runs for the tensor-core decode kernel (apl_gemv.cu) and its tiles regime, in one GPU call.

Times decode shapes (bench/apl_moe_kernel.py's method: layer copies, fresh routing per call,
CUDA-graph replays) under variants of its compile-time knobs (KERNEL_DEFINES) and host
plan constants, and prints one line per (variant, shape). Used to pick the defaults; the
results are recorded in docs/kernel.md.

Usage on the GPU machine: PYTHONPATH=.:services:kernels python3 -m bench.apl_gemv_variants [variants] [--mixed | --tiles]
"""

import sys

import torch

import pagedweight_kernels.apl_moe as op
from bench.apl_moe_kernel import COPIES, MODELS, REPS, SyntheticLayer, bit_assignment, routings, time_calls

SHAPES = [("mixtral-8x7b", 1, "3"), ("mixtral-8x7b", 1, "4"), ("mixtral-8x7b", 1, "8"), ("mixtral-8x7b", 1, "mixed"),
          ("mixtral-8x7b", 4, "4"), ("qwen1.5-moe-a2.7b", 1, "4"), ("qwen1.5-moe-a2.7b", 1, "mixed"),
          ("qwen1.5-moe-a2.7b", 16, "4")]
BASE = dict(op.KERNEL_DEFINES)
HOST_KNOBS = {name: getattr(op, name) for name in ("GEMV_TARGET_CTAS", "GEMV_MERGE_CLASSES", "TILES_MAX_NT8")}
VARIANTS = {  # name -> (define changes, host changes)
    "base": ({}, {}),
    "no_l2_prefetch": ({"APL_GEMV_L2_PREFETCH": 0}, {}),
    "target_1056": ({}, {"GEMV_TARGET_CTAS": 1056}),
    "4byte_loads": ({}, {"aligned8": False}),
    "merged_classes": ({}, {"GEMV_MERGE_CLASSES": True}),
    "ring3": ({"APL_GEMV_RING_STAGES": 3}, {}),  # 3-4 bits: plane words through a cp.async ring
    "ring4": ({"APL_GEMV_RING_STAGES": 4}, {}),
    "ring6": ({"APL_GEMV_RING_STAGES": 6}, {}),
    "tiles_3_blocks": ({"APL_TILES_MIN_BLOCKS": 3}, {}),  # tiles regime: <= 168 registers, 3 CTAs per SM
    "tiles_max_32": ({}, {"TILES_MAX_NT8": 4}),  # tiles regime: at most 32 tokens per pass
}
MIXED_SHAPES = [("qwen1.5-moe-a2.7b", 1, "mixed"), ("qwen1.5-moe-a2.7b", 4, "mixed"), ("mixtral-8x7b", 1, "mixed"),
                ("mixtral-8x7b", 4, "mixed"), ("qwen1.5-moe-a2.7b", 1, "4")]
TILES_SHAPES = [("qwen1.5-moe-a2.7b", 64, "4"), ("qwen1.5-moe-a2.7b", 256, "4"), ("mixtral-8x7b", 64, "4"),
                ("mixtral-8x7b", 256, "4"), ("mixtral-8x7b", 256, "8")]


def main():
    device = torch.device("cuda")
    shapes = MIXED_SHAPES if "--mixed" in sys.argv else TILES_SHAPES if "--tiles" in sys.argv else SHAPES
    names = sorted({s[0] for s in shapes})
    layers = {name: [SyntheticLayer(*MODELS[name][:1], *MODELS[name][2:], seed, device) for seed in range(COPIES)]
              for name in names}
    cases = {}
    for name, T, bits in shapes:
        E, k, H, I = MODELS[name]
        apl = [layer.apl(bit_assignment(bits, E, 17)) for layer in layers[name]]
        route = routings(T, E, k, REPS, device, seed=T)
        x = [torch.randn(T, H, device=device).bfloat16() for _ in range(REPS)]
        cases[(name, T, bits)] = (x, route, apl)
    only = [a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS)
    for vname in only:
        defines, host = VARIANTS[vname]
        op.KERNEL_DEFINES.clear()
        op.KERNEL_DEFINES.update(BASE, **defines)
        for knob, value in HOST_KNOBS.items():
            setattr(op, knob, host.get(knob, value))
        for shape in shapes:
            x, route, apl = cases[shape]
            for layer in apl:
                layer._summarise()
                if "aligned8" in host:
                    layer.aligned8 = {m: host["aligned8"] for m in layer.aligned8}
            calls = [lambda c=i % COPIES, i=i: op.apl_moe(x[i], *route[i], apl[c]) for i in range(REPS)]
            print(f"{vname:16s} {shape[0]:18s} T={shape[1]:3d} bits={shape[2]:5s} {time_calls(calls):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
