#!/bin/bash
# One device call (issue 13/14, ~5 minutes): where the fused kernel's decode warps stall, and
# the Mixtral shape's streaming quantisation time with the current quantiser.
#  1. tests/offline/test_family_kernel_gpu.py's gemma4 cases (the overlap fix of 2026-12-01).
#  2. Nsight Compute, full set, on one layer call of the decode kernel (Mixtral-8x7B and
#     Qwen1.5-MoE sizes, 1 token, 4 bits): the details page and, per SASS instruction, the
#     warp-stall samples (source page, CSV), which bench/ncu_stall_table.py turns into a table.
#  3. bench/quantize_full_depth.sh at the Mixtral-8x7B shape with 2 decoder layers
#     (per-layer and fixed seconds, extrapolated to 32 layers; peak device memory).
# Usage (device): OUT=$OUT CODE_COMMIT=<commit> bash bench/kernel_stalls_gpu.sh
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
OUT=$(cd "${OUT:-bench/results}" && pwd)
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/offline/test_family_kernel_gpu.py -k gemma4 > "$OUT/gpu_family_gemma4.log" 2>&1
stamp "gemma4 tests rc $?"; tail -n 2 "$OUT/gpu_family_gemma4.log"
if command -v ncu > /dev/null; then
  for model in mixtral-8x7b qwen1.5-moe-a2.7b; do
    rep=/tmp/ncu_$model
    timeout 100 ncu --clock-control none --kernel-name regex:apl_ --launch-skip 6 --launch-count 2 \
      --set full --import-source no -f -o "$rep" \
      python3 bench/profile_apl_moe.py --model $model --tokens 1 --bits 4 > /tmp/ncu_$model.log 2>&1
    stamp "ncu $model rc $?"; tail -n 3 /tmp/ncu_$model.log
    ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_${model}_t1_b4_details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${model}_t1_b4_sass.csv" 2>&1 \
      || stamp "source page rc $?: $(head -c 300 "$OUT/ncu_${model}_t1_b4_sass.csv")"
  done
else
  stamp "no ncu"
fi
PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown} \
  MODEL=Mixtral-8x7B LAYERS=2 NAME=quantize_mixtral_2layer CALIB=2048 DEADLINE_S=240 \
  bash bench/quantize_full_depth.sh > "$OUT/quantize_mixtral_2layer.log" 2>&1
stamp "mixtral quantise rc $?"; grep -v "it/s\]$" "$OUT/quantize_mixtral_2layer.log" | grep -i "seconds\|peak\|wrote" | head -20
rm -f "$OUT"/quantize_mixtral_2layer.samples.jsonl "$OUT"/df_*.txt
