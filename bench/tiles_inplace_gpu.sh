#!/bin/bash
# One device call (issue 13): the tiles regime on wgmma with x and h in the B layout's column
# order (copied in place, no reorder) and the batched loads (APL_GEMV_BATCHED_LOADS). The GPU
# tests of the tiles regime, the knob flips and the reference cases first, then the tiles
# shapes with the loads batched and serial, and on mma.sync (APL_TILES_WGMMA=0), then the
# layer benchmark at 64 and 256 tokens, bf16 grouped_mm in the same process. The compiled
# kernels go back as $OUT/kernel_cache.tgz (a later call can carry them: same source, no compiles).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/tiles_inplace_gpu.sh
. "$(dirname "$0")/device_call.sh"
export PAGEDWEIGHT_KERNEL_CACHE=/tmp/kcache/arch CUPY_CACHE_DIR=/tmp/kcache/cupy
[ -f kernel_cache/kernel_cache.tgz ] && mkdir -p /tmp/kcache && tar xzf kernel_cache/kernel_cache.tgz -C /tmp/kcache
# bf16 instances first, in threads (the tests compile one at a time otherwise)
python3 -c "import torch; from pagedweight_kernels.apl_moe import precompile; print('precompiled', precompile(torch.bfloat16, max_workers=16))"
stamp "precompile rc $?"
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "${TEST_TIMEOUT_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -x \
  ${TEST_FILES:-tests/kernels/test_apl_tiles_wgmma_gpu.py tests/kernels/test_apl_moe_gpu.py} \
  -k "${TEST_K:-tiles or knobs or kernel_matches_reference or uniform_width_layers or no_host_sync}" > "$OUT/gpu_inplace_tests.log" 2>&1
rc=$?; stamp "tests rc $rc"; tail -n 30 "$OUT/gpu_inplace_tests.log" | grep -v "^$" | tail -n 25
[ "$rc" = 0 ] || exit 1
timeout "${VARIANTS_TIMEOUT_S:-200}" python3 -m bench.apl_gemv_variants base serial_loads mma_sync --tiles --json apl_gemv_inplace \
  > "$OUT/apl_gemv_inplace.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_inplace.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_inplace.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-150}" python3 -m bench.apl_moe_kernel --tokens 64 256 --bits 4 8 mixed \
  --no-per-block --no-legacy --name apl_moe_kernel_inplace --out "$OUT/apl_moe_kernel_inplace.json" > "$OUT/apl_moe_kernel_inplace.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_inplace.log" | sed 's/  */ /g'
tar czf "$OUT/kernel_cache.tgz" -C /tmp/kcache . && stamp "kernel cache $(du -h "$OUT/kernel_cache.tgz" | cut -f1)"
