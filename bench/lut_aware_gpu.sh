#!/bin/bash
# One device call (issue 13, 2026-12-03): decode launches that reserve shared LUT rows (5-8-bit,
# merged, stable) with their split capped so 4 CTAs fit an SM (GEMV_LUT_AWARE_CTAS 4, the default
# under test at 1fe6f5e, off since: measured slower) against the split the staging budget alone
# allows (8-bit LUT rows leave 3 CTAs per SM from 2 tokens up), natural and stable launches, on the shapes it changes (--lut, with
# the mixed layers' byte-weighted times), in one process; then the capped-split GPU tests
# (tests/kernels/test_apl_lut_aware_gpu.py), or with FULL=1 the whole GPU suite at the default.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [SKIP_TESTS=1] [FULL=1] bash bench/lut_aware_gpu.sh
. "$(dirname "$0")/device_call.sh"
# (the run of 1fe6f5e, where 4 was the default: VARIANTS="base lut_unaware stable lut_unaware_stable")
VARIANTS=${VARIANTS:-base lut_aware stable lut_aware_stable}
timeout "${VARIANTS_TIMEOUT_S:-200}" python3 -m bench.apl_gemv_variants $VARIANTS --lut --json apl_gemv_lut_aware \
  > "$OUT/apl_gemv_lut_aware.log" 2>&1
stamp "variants rc $?"
# (the 1-token 3-7-bit rows, which only weigh bytes and the cap never changes, left out of the tail)
grep -E " us$|byte-weighted" "$OUT/apl_gemv_lut_aware.log" | grep -v "T= *1 bits=[3-7]" \
  | sed 's/qwen1.5-moe-a2.7b/qwen/;s/mixtral-8x7b/mixtral/;s/byte-weighted/bw/;s/  */ /g' | cut -c1-80
cp bench/results/apl_gemv_lut_aware.json "$OUT/" 2>/dev/null
[ -n "${SKIP_TESTS:-}" ] && exit 0
if [ -z "${FULL:-}" ]; then
  PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    --tb=short tests/kernels/test_apl_lut_aware_gpu.py > "$OUT/gpu_tests_lut_aware.log" 2>&1
  stamp "lut-aware tests rc $?"; tail -n 15 "$OUT/gpu_tests_lut_aware.log" | grep -v "^$"
  exit 0
fi
PATHS=1 TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-320} bash "$(dirname "$0")/gpu_tests_sharded_gpu.sh" 2>&1 | tail -n 12
