#!/bin/bash
# One device call (issue 13, written 2026-12-05, fifth session; run in the sixth at 85ad85f, on an H100:
# bench/results/apl_gemv_staged_wg2.json, apl_moe_kernel_staged_wg2_*.json): the second producer warpgroup
# of the 5-8-bit and merged classes (apl_staged.cu's APL_STAGED_LUT_PRODUCERS 2: 384 threads a CTA). Since
# 7dc961f two warpgroups (with APL_STAGED_PREFETCH_LUT 1) are the defaults, so a re-run compares against
# one warpgroup by its sets (LAYER_DEFINES=APL_STAGED_LUT_PRODUCERS=1,APL_STAGED_PREFETCH_LUT=2, and
# KNOB_SETS to match). Steps, each skipped where its variable is "none":
#   1-3. bench/staged_lut_gpu.sh: every instance at the default knobs, and the 5-8-bit and merged
#        classes' staged instances at each KNOB_SETS entry (precompile); the GPU knob tests with two
#        producer warpgroups against the defaults, bit for bit (TESTS_K); VARIANTS at its SHAPES;
#   4. LAYER_DEFINES: the layer benchmark (bf16 grouped_mm beside it, each in its own process) at the
#      default knobs and at each ";"-separated entry (APL_KERNEL_DEFINES), LAYER_BITS, LAYER_TOKENS.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/staged_producers_gpu.sh
here=$(dirname "$0")
KNOB_SETS=${KNOB_SETS:-APL_STAGED_LUT_PRODUCERS=2;APL_STAGED_LUT_PRODUCERS=2,APL_STAGED_PREFETCH_LUT=1} \
  TESTS_K=${TESTS_K:-PRODUCERS} JSON=${JSON:-apl_gemv_staged_wg2} \
  VARIANTS=${VARIANTS:-staged_all staged_wg2_all staged_wg2_p1_all} bash "$here/staged_lut_gpu.sh"
. "$here/device_call.sh"
if [ "${LAYER_DEFINES:-APL_STAGED_LUT_PRODUCERS=2}" != none ]; then
  IFS=';' read -r -a sets <<< ";${LAYER_DEFINES:-APL_STAGED_LUT_PRODUCERS=2}"  # (the first, empty: the defaults)
  for i in "${!sets[@]}"; do
    APL_KERNEL_DEFINES=${sets[$i]} layer_bench "apl_moe_kernel_staged_wg2_$i" "${BENCH_TIMEOUT_S:-120}" \
      --tokens ${LAYER_TOKENS:-64 256} --bits ${LAYER_BITS:-8 mixed}
    stamp "layer bench [${sets[$i]:-defaults}] rc $?"; grep -E "T=" "$OUT/apl_moe_kernel_staged_wg2_$i.log" | sed 's/  */ /g'
  done
fi
