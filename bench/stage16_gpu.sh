#!/bin/bash
# One short device call (issue 13): the decode kernel's activations staged by 16-byte loads
# (APL_GEMV_STAGE16; Nsight at c5d0986 put the 2-byte staging loads' PRMT at the top of Qwen's
# stall samples) against the 2-byte loads, then the decode GPU tests with it on.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/stage16_gpu.sh
. "$(dirname "$0")/device_call.sh"
timeout 75 python3 -m bench.apl_gemv_variants stage2 stage16 --waves --json apl_gemv_stage16 > "$OUT/apl_gemv_stage16.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_stage16.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_stage16.json "$OUT/" 2>/dev/null
APL_KERNEL_DEFINES=APL_GEMV_STAGE16=1 timeout "${TEST_TIMEOUT_S:-140}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  --tb=short tests/kernels/test_apl_moe_gpu.py -k "kernel_matches_reference or uniform_width_layers or fused_decode \
  or stable_launches or compact_decode or no_valid_expert or no_host_sync" > "$OUT/gpu_stage16_tests.log" 2>&1
stamp "decode tests (APL_GEMV_STAGE16=1) rc $?"; tail -n 3 "$OUT/gpu_stage16_tests.log"
