#!/bin/bash
# One device call (issue 13, 2026-12-03, third session): the decode instances compiled for long column
# splits (apl_gemv's LONG: L2::256B plane loads, picked by the host's long_split from the split and row
# lengths and the tokens staged, GEMV_LONG_*). First their GPU tests (bit for bit
# against the plain instances, and the reference), then the variants on every decode width at 1 / 4 / 16
# tokens at both sizes, each variant's mixed layers weighed by its own uniform rates; optionally the
# layer benchmark (LAYER=1) at the default. The second call (c697377: the rule by rows and tokens) ran
# VARIANTS="base long_off long_any stable stable_long_off" TAG=rule LAYER=1; the third (the 5-bit LUT rows'
# stagger) TESTS=tests/kernels/test_apl_lut_stagger_gpu.py VARIANTS="base stagger_off stable stable_stagger_off"
# TAG=stagger LAYER=1.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [TESTS="pytest args"] [VARIANTS="..."] [TAG=t] [SKIP_VARIANTS=1] [LAYER=1]
#   bash bench/long_split_gpu.sh
. "$(dirname "$0")/device_call.sh"
TAG=${TAG:-long}
VARIANTS=${VARIANTS:-base long_off long_merged long_w128 stable stable_long_off}
TESTS=${TESTS:-tests/kernels/test_apl_plane_hint_gpu.py -k long_split}
timeout "${TESTS_TIMEOUT_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short $TESTS \
  > "$OUT/gpu_tests_$TAG.log" 2>&1
stamp "tests rc $? ($(tail -n 1 "$OUT/gpu_tests_$TAG.log"))"
if [ -z "${SKIP_VARIANTS:-}" ]; then
  timeout "${VARIANTS_TIMEOUT_S:-330}" python3 -m bench.apl_gemv_variants $VARIANTS --long --json apl_gemv_long_$TAG \
    > "$OUT/apl_gemv_long_$TAG.log" 2>&1
  stamp "variants rc $?"; cp bench/results/apl_gemv_long_$TAG.json "$OUT/" 2>/dev/null
  # the tail: one line per shape, the variants' times side by side (mixed: over byte-weighted)
  python3 -m bench.variants_table "$OUT/apl_gemv_long_$TAG.json"
fi
if [ -n "${LAYER:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-260}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 64 256 --bits 3 4 5 6 8 mixed \
    --no-per-block --name apl_moe_kernel_$TAG --out "$OUT/apl_moe_kernel_$TAG.json" > "$OUT/apl_moe_kernel_$TAG.log" 2>&1
  stamp "layer bench rc $?"; grep -E "byte-weighted" "$OUT/apl_moe_kernel_$TAG.log" | sed 's/  */ /g' | cut -c1-100 | head -20
fi
