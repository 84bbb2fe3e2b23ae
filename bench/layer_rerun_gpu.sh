#!/bin/bash
# One device call (issue 13, 2026-12-02): the tiles-regime knobs never run on wgmma
# (TILES_MAX_NT8 4: at most 32 tokens a pass; 3 CTAs per SM) against the defaults, then the
# layer benchmark at every shape (1-256 tokens, 3-8 bits and mixed, with the first decode
# kernel and bf16 grouped_mm in the same process): the record docs/kernel.md's tables cite.
# Carry kernel_cache/ from an earlier call of the same source to skip the compiles.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/layer_rerun_gpu.sh
. "$(dirname "$0")/device_call.sh"
timeout "${VARIANTS_TIMEOUT_S:-150}" python3 -m bench.apl_gemv_variants base tiles_max_32 wgmma_3_blocks --tiles \
  --json apl_gemv_tiles_knobs > "$OUT/apl_gemv_tiles_knobs.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_tiles_knobs.log" | sed 's/  */ /g'
cp bench/results/apl_gemv_tiles_knobs.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-330}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 64 256 --bits 3 4 5 6 8 mixed \
  --no-per-block --name apl_moe_kernel_rerun --out "$OUT/apl_moe_kernel_rerun.json" > "$OUT/apl_moe_kernel_rerun.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy|byte-weighted" "$OUT/apl_moe_kernel_rerun.log" | sed 's/  */ /g'
