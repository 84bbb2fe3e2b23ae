#!/bin/bash
# One device call for the one-launch decode (issue 13): compile the decode instances, time
# base (fused) vs unfused at the 3-4-bit decode shapes, run the decode GPU tests, and read
# Nsight Compute counters for Qwen1.5-MoE at 1 token, 4 bits, both paths. Outputs under $OUT.
# Usage (device): cd <tree> && bash bench/fused_decode_gpu_run.sh
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
stamp compile
#timeout 60 python3 -m bench.apl_gemv_variants base --compile-only > "$OUT/compile.log" 2>&1; stamp "compile rc $?"
timeout 75 python3 -m bench.apl_gemv_variants base unfused --fused --json apl_gemv_fused_variants > "$OUT/bench.log" 2>&1
stamp "bench rc $?"; cp bench/results/apl_gemv_fused_variants.json "$OUT/" 2>/dev/null
K='fused or (uniform_width_layers_match and not tiles) or (kernel_matches and not T40 and not T100 and not T200 and not T64) or no_valid or no_host_sync or one_launch'
timeout 100 python3 -m pytest -q -p no:cacheprovider -k "$K" --durations=5 tests/kernels/test_apl_moe_gpu.py > "$OUT/tests.log" 2>&1
stamp "tests rc $?"
if command -v ncu > /dev/null; then
  S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats"
  APL_GEMV_FUSED=0 timeout 30 ncu --clock-control none --kernel-name regex:apl_ --launch-skip 6 --launch-count 2 $S \
    python3 bench/profile_apl_moe.py --model qwen1.5-moe-a2.7b --tokens 1 --bits 4 > "$OUT/ncu_unfused.txt" 2>&1
  stamp "ncu unfused rc $?"
  APL_GEMV_FUSED=1 timeout 30 ncu --clock-control none --kernel-name regex:apl_ --launch-skip 3 --launch-count 1 $S \
    python3 bench/profile_apl_moe.py --model qwen1.5-moe-a2.7b --tokens 1 --bits 4 > "$OUT/ncu_fused.txt" 2>&1
  stamp "ncu fused rc $?"
else
  stamp "no ncu"
fi
tail -3 "$OUT/tests.log"; grep " us$" "$OUT/bench.log"
