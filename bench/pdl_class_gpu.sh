#!/bin/bash
# One device call (issue 13, 2026-12-02, third session): programmatic launch of down only for the
# 3-4-bit decode kernel and the tiles regime (programmatic_down), against serial launches, every
# decode and tiles shape in one process each; then the programmatic-launch GPU tests.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/pdl_class_gpu.sh
. "$(dirname "$0")/device_call.sh"
for run in "decode --decode" "tiles --tiles"; do
  set -- $run
  timeout 150 python3 -m bench.apl_gemv_variants base no_pdl "$2" --json "apl_gemv_pdl_class_$1" \
    > "$OUT/apl_gemv_pdl_class_$1.log" 2>&1
  stamp "$1 rc $?"; grep " us$" "$OUT/apl_gemv_pdl_class_$1.log" | sed 's/  */ /g'
  cp "bench/results/apl_gemv_pdl_class_$1.json" "$OUT/" 2>/dev/null
done
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/kernels/test_apl_pdl_gpu.py \
  > "$OUT/gpu_tests_pdl.log" 2>&1
stamp "pdl tests rc $?: $(tail -n 1 "$OUT/gpu_tests_pdl.log")"
