#!/bin/bash
# One device call (issue 13): APL_TILES_PAIR, the tiles regime on wgmma in clusters of 2 CTAs
# that each stage half a step into both CTAs' shared memory (written 2026-12-01 without a GPU).
# The bf16 instances compiled first, in threads (default and pair defines, two processes: the
# disk cache carries over), then the pair's GPU tests (bit for bit against one CTA staging),
# then the tiles shapes with and without it in one process, and the layer benchmark with it on.
# Carry kernel_cache/ from an earlier call of the same source to skip the compiles.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/tiles_pair_gpu.sh
. "$(dirname "$0")/device_call.sh"
pre="import torch; from pagedweight_kernels.apl_moe import precompile; print('precompiled', precompile(torch.bfloat16, max_workers=16))"
python3 -c "$pre" && APL_KERNEL_DEFINES=APL_TILES_PAIR=1 python3 -c "$pre"
stamp "precompile rc $?"
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -x \
  tests/kernels/test_apl_tiles_wgmma_gpu.py -k "${TEST_K:-cluster_pair}" > "$OUT/gpu_pair_tests.log" 2>&1
rc=$?; stamp "pair tests rc $rc"; tail -n 20 "$OUT/gpu_pair_tests.log" | grep -v "^$" | tail -n 15
[ "$rc" = 0 ] || exit 1
timeout "${VARIANTS_TIMEOUT_S:-120}" python3 -m bench.apl_gemv_variants base pair --tiles --json apl_gemv_pair \
  > "$OUT/apl_gemv_pair.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_pair.log" | sed 's/  */ /g'; cp bench/results/apl_gemv_pair.json "$OUT/" 2>/dev/null
APL_KERNEL_DEFINES=APL_TILES_PAIR=1 timeout "${BENCH_TIMEOUT_S:-90}" python3 -m bench.apl_moe_kernel --tokens 64 256 --bits 4 8 mixed \
  --no-per-block --no-legacy --name apl_moe_kernel_pair --out "$OUT/apl_moe_kernel_pair.json" > "$OUT/apl_moe_kernel_pair.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_pair.log" | sed 's/  */ /g'
