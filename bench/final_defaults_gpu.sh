#!/bin/bash
# One device call (issue 13, 2026-12-05, sixth session): the kernel at its final defaults, measured and
# tested whole. Steps, each skipped where its variable is "none":
#   1. every default instance (both dtypes and activations), in threads;
#   2. LAYER: the layer benchmark at every token count and width of bench/apl_moe_kernel.py (5 and 6
#      bits too, for the mixed layers' byte-weighted times), bf16 grouped_mm beside it, one process;
#   3. SUITE: every GPU test (bench/gpu_tests_sharded_gpu.sh: SHARDS parallel pytest processes beside
#      the path tests), each shard stopped at TEST_TIMEOUT_S.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/final_defaults_gpu.sh
here=$(dirname "$0")
. "$here/device_call.sh"
precompile_defaults
stamp "precompile rc $?"
if [ "${LAYER:-1}" != none ]; then
  layer_bench "${LAYER_NAME:-apl_moe_kernel_final}" "${BENCH_TIMEOUT_S:-240}" --bits 3 4 5 6 8 mixed
  stamp "layer bench rc $?"; grep -E "T=" "$OUT/${LAYER_NAME:-apl_moe_kernel_final}.log" | grep -v " bits=[56] " | sed 's/  */ /g'
fi
if [ "${SUITE:-1}" != none ]; then
  PRECOMPILE=none SHARDS=${SHARDS:-6} TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-300} bash "$here/gpu_tests_sharded_gpu.sh"
fi
# (a call returns at most 8 files: the shards' logs travel as one archive)
if ls "$OUT"/gpu_tests_*.log > /dev/null 2>&1; then
  tar czf "$OUT/gpu_tests_logs.tgz" -C "$OUT" $(cd "$OUT" && ls gpu_tests_*.log) && rm "$OUT"/gpu_tests_*.log
fi
