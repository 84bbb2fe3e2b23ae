#!/bin/bash
# One device call (issue 13): the integer-pipe knobs (APL_FMA_SHIFTS_MIN_BITS, APL_PRMT_SELECT,
# APL_SHIFT_MODE) and the acq_rel last-CTA counter (APL_GEMV_ACQREL) against the defaults on
# every decode shape in one process; their bit-for-bit GPU test; then, with the candidate
# defaults (CAND, through APL_KERNEL_DEFINES), the layer benchmark against bf16 grouped_mm and
# the kernel's GPU tests. Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/alu_knobs_gpu.sh
# Run at 18a43a5 (bench/results/apl_gemv_alu_variants.json), where CAND read APL_FMA_SHIFTS=1 (now
# APL_FMA_SHIFTS_MIN_BITS=3) and the defaults had APL_GEMV_ACQREL 0.
. "$(dirname "$0")/device_call.sh"
VARIANTS=${VARIANTS:-base acqrel fma_shifts prmt_select alu_diet alu_acqrel alu_pipe3_late}
CAND=${CAND:-APL_FMA_SHIFTS_MIN_BITS=3,APL_PRMT_SELECT=1,APL_SHIFT_MODE=1,APL_GEMV_ACQREL=1}
timeout "${VARIANTS_TIMEOUT_S:-280}" python3 -m bench.apl_gemv_variants $VARIANTS --decode --json apl_gemv_alu_variants \
  > "$OUT/apl_gemv_alu_variants.log" 2>&1
stamp "variants rc $?"; grep " us$" "$OUT/apl_gemv_alu_variants.log"; tail -n 2 "$OUT/apl_gemv_alu_variants.log"
cp bench/results/apl_gemv_alu_variants.json "$OUT/" 2>/dev/null
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/kernels/test_apl_moe_gpu.py \
  -k integer_pipe_knobs > "$OUT/gpu_alu_knobs_tests.log" 2>&1
stamp "knob tests rc $?"; tail -n 3 "$OUT/gpu_alu_knobs_tests.log"
APL_KERNEL_DEFINES=$CAND timeout 100 python3 -m bench.apl_moe_kernel --tokens 1 4 16 --bits 3 4 8 mixed --no-per-block \
  --no-legacy --name apl_moe_kernel_alu > "$OUT/apl_moe_kernel_alu.log" 2>&1
stamp "layer bench ($CAND) rc $?"; grep "T=" "$OUT/apl_moe_kernel_alu.log"
cp bench/results/apl_moe_kernel_alu.json "$OUT/" 2>/dev/null
left=$(( ${BUDGET_S:-570} - ($(date +%s) - t0) ))
APL_KERNEL_DEFINES=$CAND timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_apl_moe_gpu.py -k "not integer_pipe_knobs and not perplexity" > "$OUT/gpu_kernels_alu.log" 2>&1
stamp "kernel tests ($CAND) rc $?"; tail -n 3 "$OUT/gpu_kernels_alu.log"
