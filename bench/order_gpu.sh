#!/bin/bash
# One device call (issue 13, 2026-12-02, fourth session): APL_GEMV_ORDER, the CTA order of the
# 5-8-bit and merged kernels (widest experts first, expert-major CTA numbering; in the tiles
# regime too at 7). First the variants on the mixed shapes (1-256 tokens) and uniform 4 and 8 bits,
# in one process (which compiles their instances in threads), with the mixed layers' byte-weighted
# times from uniform 3-8-bit layers timed once in the same process; then the order GPU tests
# (ordered launches bit for bit equal to natural ones). The first call (df20185) ran
# VARIANTS="base order_3 order_7 order_3_waves"; the second (ec8c2d0, TAG=split) the default list; the
# third (TAG=stable, SKIP_TESTS=1) VARIANTS="base order_5 order_7 stable order_1_stable order_2_stable
# order_5_stable order_7_stable"; the fourth (2026-12-03, the default 5 with the heavy order from 2 tokens,
# TAG=default, SKIP_TESTS=1) VARIANTS="base order_0 heavy_all stable order_0_stable heavy_all_stable wide_2w
# wide_4w wide_2w_stable wide_4w_stable", then bench/gpu_tests_sharded_gpu.sh; the fifth (TAG=per_class)
# VARIANTS="base per_class", then the layer benchmark (apl_moe_kernel_order, docs/kernel.md's command).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="base order_1 order_3 ..."] bash bench/order_gpu.sh
. "$(dirname "$0")/device_call.sh"
TAG=${TAG:-split}
VARIANTS=${VARIANTS:-base order_1 order_3 order_5 order_7 order_15 stable order_7_stable}
timeout "${VARIANTS_TIMEOUT_S:-260}" python3 -m bench.apl_gemv_variants $VARIANTS --order --json apl_gemv_order_$TAG \
  > "$OUT/apl_gemv_order_$TAG.log" 2>&1
stamp "variants rc $?"; grep -E " us$|byte-weighted" "$OUT/apl_gemv_order_$TAG.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_order_$TAG.json "$OUT/" 2>/dev/null
[ -n "${SKIP_TESTS:-}" ] && exit 0
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "${TEST_TIMEOUT_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_apl_order_gpu.py > "$OUT/gpu_order_tests.log" 2>&1
stamp "order tests rc $?"; tail -n 25 "$OUT/gpu_order_tests.log" | grep -v "^$" | tail -n 20
