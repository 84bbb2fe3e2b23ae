#!/bin/bash
# One device call (issue 13, 2026-12-03, second session): the plane words' cache qualifiers
# (APL_PLANE_HINT: L1::no_allocate, L2::256B / 128B prefetch sizes) at decode and in the tiles regime,
# the same under stable launches (the merged kernel at any bits, what the elastic runtime serves),
# and the 5-8-bit and merged kernels' down launched programmatically with their shared LUT rows
# filled after the wait (pdl_merged), in one process with the mixed layers' byte-weighted times;
# then Nsight Compute's warp-state and instruction summaries of one Mixtral-size 1-token 4-bit
# layer call, the 3-4-bit kernel against the stable launch (where the merged kernel's 3-4-bit
# path loses its time).
# The first call (dfa916b, no hint by default) ran VARIANTS="base hint_1 hint_2 hint_3 hint_5 stable stable_hint_1
# stable_hint_3 pdl_merged stable_pdl_merged"; the second (the rule: L2::256B on splits of >= 128 words, TAG=rule,
# SKIP_NCU=1, LAYER=1, at 9cabb61, whose variants were since replaced: measured slower) VARIANTS="base hint_0 hint_2 hint_2_w64 stable
# stable_hint_0", then the layer benchmark (docs/kernel.md's command); the third (the hint in the tiles instances
# of 64-token passes, TAG=tiles SET=--tiles SKIP_NCU=1 LAYER=1) the default list.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="..."] [TAG=t] [SET=--hint] [SKIP_NCU=1] [LAYER=1] bash bench/hint_gpu.sh
. "$(dirname "$0")/device_call.sh"
TAG=${TAG:-tiles}
VARIANTS=${VARIANTS:-base hint_0 hint_nt4 hint_2}
timeout "${VARIANTS_TIMEOUT_S:-300}" python3 -m bench.apl_gemv_variants $VARIANTS ${SET:---tiles} --json apl_gemv_hint_$TAG \
  > "$OUT/apl_gemv_hint_$TAG.log" 2>&1
stamp "variants rc $?"; cp bench/results/apl_gemv_hint_$TAG.json "$OUT/apl_gemv_hint.json" 2>/dev/null
# the tail: one line per shape, the variants' times side by side
python3 -m bench.variants_table "$OUT/apl_gemv_hint.json"
if [ -n "${LAYER:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-240}" python3 -m bench.apl_moe_kernel --tokens 1 4 16 64 256 --bits 3 4 5 6 8 mixed \
    --no-per-block --name apl_moe_kernel_hint --out "$OUT/apl_moe_kernel_hint.json" > "$OUT/apl_moe_kernel_hint.log" 2>&1
  stamp "layer bench rc $?"; grep -E "byte-weighted" "$OUT/apl_moe_kernel_hint.log" | sed 's/  */ /g' | cut -c1-100 | head -20
fi
[ -n "${SKIP_NCU:-}" ] && exit 0
if command -v ncu > /dev/null; then
  for mode in base stable; do
    flag=$([ $mode = stable ] && echo --stable)
    timeout 90 ncu --clock-control none --kernel-name regex:apl_gemv --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section InstructionStats --section MemoryWorkloadAnalysis -f -o /tmp/ncu_$mode \
      python3 bench/profile_apl_moe.py --model mixtral-8x7b --tokens 1 --bits 4 $flag > /tmp/ncu_$mode.log 2>&1
    stamp "ncu $mode rc $?"
    ncu -i /tmp/ncu_$mode.ncu-rep --page details > "$OUT/ncu_mixtral_t1_b4_${mode}_hint.txt" 2>&1
    grep -E "apl_gemv|Duration|Stall|Warp Cycles Per Issued|L1/TEX Hit|Achieved Occupancy|Shared Memory Configuration Size|Executed Ipc A" \
      "$OUT/ncu_mixtral_t1_b4_${mode}_hint.txt" | sed 's/  */ /g' | cut -c1-110 | head -40
  done
else
  stamp "no ncu"
fi
