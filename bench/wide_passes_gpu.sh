#!/bin/bash
# One device call (issue 13, 2026-12-03, fourth session): TILES_WIDE_NT8, 96-token passes (NT8 12,
# wgmma m64n96k16) for 3-4-bit layers whose mean tokens per expert want more than 64 a pass
# (Mixtral-size prefill at 256 tokens: 8 experts, 46-82 tokens each, so 12 passes of 64 became 8
# of 96). Its GPU tests first (against the reference, both widths, mma.sync too), then the tiles
# shapes with and without it in one process, then the layer benchmark with it at 64 / 256 tokens
# and 3 / 4 bits (grouped_mm timed beside it).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/wide_passes_gpu.sh
. "$(dirname "$0")/device_call.sh"
pre="import torch, pagedweight_kernels.apl_moe as op; op.TILES_WIDE_NT8 = 12; print('precompiled', op.precompile(torch.bfloat16, max_workers=16))"
python3 -c "$pre"
stamp "precompile rc $?"
PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout -k 10 "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  --tb=short -x tests/kernels/test_apl_tiles_wgmma_gpu.py -k "wide_passes" > "$OUT/gpu_wide_tests.log" 2>&1
rc=$?; stamp "wide tests rc $rc"; tail -n 20 "$OUT/gpu_wide_tests.log" | grep -v "^$" | tail -n 15
[ "$rc" = 0 ] || exit 1
timeout -k 10 "${VARIANTS_TIMEOUT_S:-150}" python3 -m bench.apl_gemv_variants base wide12 --tiles --json apl_gemv_wide \
  > "$OUT/apl_gemv_wide.log" 2>&1
stamp "variants rc $?"; cp bench/results/apl_gemv_wide.json "$OUT/" 2>/dev/null
python3 -m bench.variants_table "$OUT/apl_gemv_wide.json"
timeout -k 10 "${BENCH_TIMEOUT_S:-120}" python3 -c "
import sys, pagedweight_kernels.apl_moe as op
op.TILES_WIDE_NT8 = 12
from bench.apl_moe_kernel import main
sys.argv = ['apl_moe_kernel', '--tokens', '64', '256', '--bits', '3', '4', '--models', 'mixtral-8x7b', '--no-per-block',
            '--no-legacy', '--name', 'apl_moe_kernel_wide', '--out', '$OUT/apl_moe_kernel_wide.json']
main()" > "$OUT/apl_moe_kernel_wide.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_wide.log" | sed 's/  */ /g'
rm -f "$OUT/kernel_cache.tgz"; trap - EXIT
