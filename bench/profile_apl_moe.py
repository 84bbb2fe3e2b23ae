"""Run one fused-kernel layer call for Nsight Compute to profile (what bounds the kernel).

Usage on the GPU machine:
  ncu --clock-control none --kernel-name regex:apl_ --launch-skip 6 --launch-count 2 \\
      --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \\
      python3 bench/profile_apl_moe.py --model mixtral-8x7b --tokens 1 --bits 4
(three warm-up calls of two GEMM launches each are skipped; the fourth call's two are profiled)
"""

import argparse
import dataclasses

import torch

from bench.apl_moe_kernel import MODELS, SyntheticLayer, bit_assignment, routings
import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import apl_moe

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mixtral-8x7b", choices=list(MODELS))
parser.add_argument("--tokens", type=int, default=1)
parser.add_argument("--bits", default="4")
parser.add_argument("--stable", action="store_true", help="stable launches (the merged kernel at any bits)")
parser.add_argument("--staged-wide", type=int, default=op.DEFAULT_CONFIG.staged_wide_nt8,
                    help="staged_wide_nt8: 16 for the staged regime's passes of 128 tokens, 0 for none")
args = parser.parse_args()
config = dataclasses.replace(op.DEFAULT_CONFIG, staged_wide_nt8=args.staged_wide)
E, k, H, I = MODELS[args.model]
device = torch.device("cuda")
layer = SyntheticLayer(E, H, I, 0, device).apl(bit_assignment(args.bits, E, 17))
layer.stable_launches = args.stable
ids, w = routings(args.tokens, E, k, 1, device, seed=1)[0]
x = torch.randn(args.tokens, H, device=device).bfloat16()
for _ in range(4):
    apl_moe(x, ids, w, layer, config=config)
torch.cuda.synchronize()
print("done")
