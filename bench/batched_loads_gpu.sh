#!/bin/bash
# One device call (issue 13): APL_GEMV_BATCHED_LOADS (routing, the reductions and the tiles'
# cp.async issue with their loads in flight together). The bf16 instances compiled first (in
# threads), then the tiles and decode shapes with the loads batched and serial in one process,
# the layer benchmark at 1-256 tokens (bf16 grouped_mm in the same process), and last the GPU
# tests of the tiles regime and the knob flips (bit for bit), as far as the time allows.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/batched_loads_gpu.sh
. "$(dirname "$0")/device_call.sh"
python3 -c "import torch; from pagedweight_kernels.apl_moe import precompile; print('precompiled', precompile(torch.bfloat16, max_workers=16))"
stamp "precompile rc $?"
timeout "${VARIANTS_TIMEOUT_S:-80}" python3 -m bench.apl_gemv_variants base serial_loads --tiles --json apl_gemv_batched_tiles \
  > "$OUT/apl_gemv_batched_tiles.log" 2>&1
stamp "tiles variants rc $?"; grep " us$" "$OUT/apl_gemv_batched_tiles.log" | sed 's/  */ /g'
timeout "${VARIANTS_TIMEOUT_S:-80}" python3 -m bench.apl_gemv_variants base serial_loads --json apl_gemv_batched_decode \
  > "$OUT/apl_gemv_batched_decode.log" 2>&1
stamp "decode variants rc $?"; grep " us$" "$OUT/apl_gemv_batched_decode.log" | sed 's/  */ /g'
cp bench/results/apl_gemv_batched_*.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-90}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 64 256 --bits 3 4 8 mixed \
  --no-per-block --no-legacy --name apl_moe_kernel_batched --out "$OUT/apl_moe_kernel_batched.json" > "$OUT/apl_moe_kernel_batched.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_batched.log" | sed 's/  */ /g'
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -x \
  tests/kernels/test_apl_moe_gpu.py tests/kernels/test_apl_tiles_wgmma_gpu.py -k "${TEST_K:-knobs or wgmma or tiles_regime_matches}" \
  > "$OUT/gpu_batched_tests.log" 2>&1
stamp "tests rc $?"; tail -n 5 "$OUT/gpu_batched_tests.log"
