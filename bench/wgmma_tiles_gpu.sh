#!/bin/bash
# One device call (issue 13): the tiles regime on wgmma (APL_TILES_WGMMA, sm_90a). Its GPU
# tests first (compiles every tiles instance for sm_90a, into compile_for_arch's disk cache),
# then the tiles shapes under mma.sync and wgmma (2 and 3 CTAs per SM), then the layer
# benchmark at 64 and 256 tokens with wgmma on, bf16 grouped_mm in the same process.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/wgmma_tiles_gpu.sh
. "$(dirname "$0")/device_call.sh"
timeout "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -x \
  tests/kernels/test_apl_tiles_wgmma_gpu.py > "$OUT/gpu_wgmma_tests.log" 2>&1
rc=$?; stamp "wgmma tests rc $rc"; tail -n 30 "$OUT/gpu_wgmma_tests.log" | grep -v "^$" | tail -n 25
[ "$rc" = 0 ] || exit 1
timeout "${VARIANTS_TIMEOUT_S:-240}" python3 -m bench.apl_gemv_variants base wgmma wgmma_3_blocks --tiles --json apl_gemv_wgmma \
  > "$OUT/apl_gemv_wgmma.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_wgmma.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_wgmma.json "$OUT/" 2>/dev/null
APL_KERNEL_DEFINES=APL_TILES_WGMMA=1 timeout "${BENCH_TIMEOUT_S:-150}" python3 -m bench.apl_moe_kernel --tokens 64 256 --bits 4 8 mixed \
  --no-per-block --no-legacy --name apl_moe_kernel_wgmma --out "$OUT/apl_moe_kernel_wgmma.json" > "$OUT/apl_moe_kernel_wgmma.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_wgmma.log" | sed 's/  */ /g'
