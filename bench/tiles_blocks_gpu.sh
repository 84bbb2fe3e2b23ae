#!/bin/bash
# One device call (issue 13, 2026-12-02): the tiles register rule (APL_TILES_BLOCKS: 3 CTAs per SM
# where the body fits 168 registers, else 2) against 2 CTAs everywhere. Every kernel GPU test
# first (bench/gpu_tests_sharded_gpu.sh, without the paths), then the tiles shapes against 2
# CTAs everywhere (tiles_2_blocks, the earlier default) in one process, then the layer
# benchmark's tiles shapes (64 and 256 tokens, 3 / 4 / 8 bits and mixed) with grouped_mm.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/tiles_blocks_gpu.sh
PATHS=0 bash "$(dirname "$0")/gpu_tests_sharded_gpu.sh"
. "$(dirname "$0")/device_call.sh"
timeout "${VARIANTS_TIMEOUT_S:-150}" python3 -m bench.apl_gemv_variants base tiles_2_blocks --tiles \
  --json apl_gemv_tiles_blocks > /tmp/apl_gemv_tiles_blocks.log 2>&1
stamp "variants rc $?"; grep " us$" /tmp/apl_gemv_tiles_blocks.log | sed 's/  */ /g'
cp bench/results/apl_gemv_tiles_blocks.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-120}" python3 -m bench.apl_moe_kernel --tokens 64 256 --bits 3 4 5 6 8 mixed --no-per-block \
  --no-legacy --name apl_moe_kernel_tiles_blocks --out "$OUT/apl_moe_kernel_tiles_blocks.json" \
  > /tmp/apl_moe_kernel_tiles_blocks.log 2>&1
stamp "layer bench rc $?"; grep -E "T=" /tmp/apl_moe_kernel_tiles_blocks.log | sed 's/  */ /g' | cut -c1-150
