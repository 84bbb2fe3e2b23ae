#!/bin/bash
# One device call (issue 13, 2026-12-02, third session), after programmatic launch became the
# default: every decode shape against serial launches (no_pdl) and against down's first planes
# loaded before its wait (pdl_planes), in one process; then the layer benchmark at every shape
# (1-256 tokens, 3-8 bits and mixed, with the first decode kernel and bf16 grouped_mm in the
# same process): the record docs/kernel.md's targets cite.
# The final-rule run of b4bd75c: VARIANTS="base no_pdl" TAG=final (apl_gemv_pdl_final_decode,
# apl_moe_kernel_final).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="base no_pdl pdl_planes"] [TAG=pdl] bash bench/pdl_rerun_gpu.sh
. "$(dirname "$0")/device_call.sh"
VARIANTS=${VARIANTS:-base no_pdl pdl_planes}
TAG=${TAG:-pdl}
D=apl_gemv_pdl_decode; [ "$TAG" = pdl ] || D=apl_gemv_pdl_${TAG}_decode
L=apl_moe_kernel_$TAG
timeout "${VARIANTS_TIMEOUT_S:-200}" python3 -m bench.apl_gemv_variants $VARIANTS --decode \
  --json $D > "$OUT/$D.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/$D.log" | sed 's/  */ /g'
cp bench/results/$D.json "$OUT/" 2>/dev/null
timeout "${BENCH_TIMEOUT_S:-340}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 64 256 --bits 3 4 5 6 8 mixed \
  --no-per-block --name $L --out "$OUT/$L.json" > "$OUT/$L.log" 2>&1
stamp "layer bench rc $?"; grep -E "T=|copy|byte-weighted" "$OUT/$L.log" | sed 's/  */ /g' | cut -c1-220
