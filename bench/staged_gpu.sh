#!/bin/bash
# One device call (issue 13, 2026-12-03, fifth session): the staged regime (apl_staged.cu: a
# producer warpgroup dequantises plane tiles into a ring of shared-memory buffers, a consumer
# warpgroup runs wgmma with both operands there; written without a GPU). Every instance compiled
# first, in threads (bf16 and fp16, STAGED_PREFILL on), then its GPU tests against the reference,
# then the tiles shapes with and without it in one process (VARIANTS), and with LAYER=1 the layer
# benchmark with it on (bf16 grouped_mm timed beside it; LAYER_STAGED= for the default rule instead).
# BENCH_ANYWAY=1 times even after a test failure.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="base staged" | VARIANTS=none] [LAYER=1] bash bench/staged_gpu.sh
# VARIANT_SHAPES=--staged times the 3-4-bit layers at 32-1024 tokens instead of the tiles shapes.
# TEST_K selects tests (pytest -k), TEST_X="" runs past a failure. A first call on a fresh machine:
# VARIANTS=none TEST_TIMEOUT_S=360 (compiles and every test, ~9 min at most); the next, while warm or
# carrying kernel_cache/: TEST_K=matches_reference VARIANTS="base staged staged_p1 staged_u4 staged_async staged_nofence" LAYER=1.
# (Before either: `make test` runs the whole staged kernel on the CPU, tests/kernels/test_staged_host_cpu.py.)
# Since 2026-12-05 the staged regime is the default for 3-4-bit layers at 256+ assignments; the next
# timing: VARIANT_SHAPES=--staged VARIANTS="base staged_wide16 tiles_only" (passes of 128 tokens, untimed).
. "$(dirname "$0")/device_call.sh"
export APL_STAGED_PREFILL=1
pre="import torch; from pagedweight_kernels.apl_moe import precompile as p; print('precompiled', p(torch.bfloat16, max_workers=16), p(torch.float16, max_workers=16))"
timeout -k 10 "${COMPILE_TIMEOUT_S:-240}" python3 -c "$pre"
stamp "precompile rc $?"
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout -k 10 "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  --tb=short ${TEST_X:--x} tests/kernels/test_apl_staged_gpu.py ${TEST_K:+-k "$TEST_K"} > "$OUT/gpu_staged_tests.log" 2>&1
rc=$?; stamp "staged tests rc $rc"; tail -n 40 "$OUT/gpu_staged_tests.log" | grep -v "^$" | tail -n 30
[ "$rc" = 0 ] || [ -n "${BENCH_ANYWAY:-}" ] || exit 1
unset APL_STAGED_PREFILL  # (the variants set STAGED_PREFILL themselves)
if [ "${VARIANTS:-base staged}" != none ]; then
  timeout -k 10 "${VARIANTS_TIMEOUT_S:-200}" python3 -m bench.apl_gemv_variants ${VARIANTS:-base staged} ${VARIANT_SHAPES:---tiles} \
    --json apl_gemv_staged > "$OUT/apl_gemv_staged.log" 2>&1
  stamp "variants rc $?"; cp bench/results/apl_gemv_staged.json "$OUT/" 2>/dev/null
  python3 -m bench.variants_table "$OUT/apl_gemv_staged.json"
fi
if [ -n "${LAYER:-}" ]; then
  APL_STAGED_PREFILL=${LAYER_STAGED-1} timeout -k 10 "${BENCH_TIMEOUT_S:-150}" python3 -m bench.apl_moe_kernel --tokens ${LAYER_TOKENS:-64 256} \
    --bits ${LAYER_BITS:-3 4 8 mixed} --no-per-block --no-legacy --name apl_moe_kernel_staged \
    --out "$OUT/apl_moe_kernel_staged.json" > "$OUT/apl_moe_kernel_staged.log" 2>&1
  stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_staged.log" | sed 's/  */ /g'
fi
rm -f "$OUT/kernel_cache.tgz"; trap - EXIT
