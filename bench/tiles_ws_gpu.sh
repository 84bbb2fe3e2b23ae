#!/bin/bash
# One device call (issue 13, 2026-12-03, fourth session): APL_TILES_WS, the tiles regime on wgmma
# with a producer warp (apl_gemv_ws: warp 4 stages each step straight into one of two B buffers,
# handed over by mbarrier, while warps 0-3 dequantise and run the step before; written without a
# GPU). The bf16 instances compiled first, in threads (default and WS defines, two processes: the
# disk cache carries over), then WS's GPU tests (bit for bit against one CTA staging), then the
# tiles shapes with and without it in one process, and optionally (LAYER=1) the layer benchmark
# with it on. Carry kernel_cache/ from an earlier call of the same source to skip the compiles.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="base ws"] [LAYER=1] bash bench/tiles_ws_gpu.sh
. "$(dirname "$0")/device_call.sh"
pre="import torch; from pagedweight_kernels.apl_moe import precompile; print('precompiled', precompile(torch.bfloat16, max_workers=16))"
python3 -c "$pre" && APL_KERNEL_DEFINES=APL_TILES_WS=1 python3 -c "$pre"
stamp "precompile rc $?"
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout -k 10 "${TEST_TIMEOUT_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  --tb=short -x tests/kernels/test_apl_tiles_wgmma_gpu.py -k "${TEST_K:-producer_warps}" > "$OUT/gpu_ws_tests.log" 2>&1
rc=$?; stamp "ws tests rc $rc"; tail -n 20 "$OUT/gpu_ws_tests.log" | grep -v "^$" | tail -n 15
[ "$rc" = 0 ] || exit 1
timeout -k 10 "${VARIANTS_TIMEOUT_S:-200}" python3 -m bench.apl_gemv_variants ${VARIANTS:-base ws ws2 ws2_s3} --tiles \
  --json apl_gemv_ws > "$OUT/apl_gemv_ws.log" 2>&1
stamp "variants rc $?"; cp bench/results/apl_gemv_ws.json "$OUT/" 2>/dev/null
python3 -m bench.variants_table "$OUT/apl_gemv_ws.json"
if [ -n "${LAYER:-}" ]; then
  APL_KERNEL_DEFINES=APL_TILES_WS=1 timeout -k 10 "${BENCH_TIMEOUT_S:-120}" python3 -m bench.apl_moe_kernel --tokens 64 256 \
    --bits 4 8 mixed --no-per-block --no-legacy --name apl_moe_kernel_ws --out "$OUT/apl_moe_kernel_ws.json" \
    > "$OUT/apl_moe_kernel_ws.log" 2>&1
  stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_ws.log" | sed 's/  */ /g'
fi
