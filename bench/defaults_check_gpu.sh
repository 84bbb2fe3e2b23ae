#!/bin/bash
# One device call (issue 13): the fused-kernel GPU tests at today's defaults (the 16-byte
# decode staging had run 35 of them), the aligned register-LUT loads (APL_GEMV_LUT16) against
# the defaults, and the layer benchmark at 1-16 tokens and every width with bf16 grouped_mm
# in the same process (the 3x target, the mixed-vs-byte-weighted ratios).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/defaults_check_gpu.sh
. "$(dirname "$0")/device_call.sh"
timeout "${TEST_TIMEOUT_S:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_apl_moe_gpu.py -k "not perplexity" > "$OUT/gpu_defaults_tests.log" 2>&1
stamp "test_apl_moe_gpu rc $?"; tail -n 4 "$OUT/gpu_defaults_tests.log"
timeout 90 python3 -m bench.apl_gemv_variants base lut16 --waves --json apl_gemv_lut16 > "$OUT/apl_gemv_lut16.log" 2>&1
stamp "lut16 variants rc $?"; grep " us$" "$OUT/apl_gemv_lut16.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_lut16.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-150}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 --bits 3 4 5 6 8 mixed --no-per-block \
  --no-legacy --name apl_moe_kernel_defaults --out "$OUT/apl_moe_kernel_defaults.json" > "$OUT/apl_moe_kernel_defaults.log" 2>&1
stamp "layer bench rc $?"; tail -n 40 "$OUT/apl_moe_kernel_defaults.log"
