#!/bin/bash
# One device call (issue 13), after the defaults took the acq_rel counter and the FMA-pipe
# shifts from 4 bits up: more CTAs per SM at decode (blocks5/6), the FMA-shift threshold
# against none and all widths, the same on the tiles regime, the bit-for-bit knob test at the
# new defaults, the layer benchmark against bf16 grouped_mm, and the kernel's GPU tests.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/occupancy_gpu.sh
. "$(dirname "$0")/device_call.sh"
run_variants() {  # name, args...
  local name=$1; shift
  timeout 150 python3 -m bench.apl_gemv_variants "$@" --json "$name" > "$OUT/$name.log" 2>&1
  stamp "$name rc $?"; grep " us$" "$OUT/$name.log" | sed 's/  */ /g'; cp "bench/results/$name.json" "$OUT/" 2>/dev/null
}
run_variants apl_gemv_occupancy base no_acqrel fma_none fma_shifts blocks5 blocks6 blocks5_t528 --decode
run_variants apl_gemv_fma_tiles base fma_none --tiles
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/kernels/test_apl_moe_gpu.py \
  -k integer_pipe_knobs > "$OUT/gpu_knobs_tests.log" 2>&1
stamp "knob tests rc $?"; tail -n 3 "$OUT/gpu_knobs_tests.log"
timeout 100 python3 -m bench.apl_moe_kernel --tokens 1 4 16 --bits 3 4 8 mixed --no-per-block --no-legacy \
  --name apl_moe_kernel_decode > "$OUT/apl_moe_kernel_decode.log" 2>&1
stamp "layer bench rc $?"; grep "T=" "$OUT/apl_moe_kernel_decode.log" | cut -c1-60,100-200
cp bench/results/apl_moe_kernel_decode.json "$OUT/" 2>/dev/null
left=$(( ${BUDGET_S:-575} - ($(date +%s) - t0) ))
timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/kernels/test_apl_moe_gpu.py \
  -k "not integer_pipe_knobs and not perplexity" > "$OUT/gpu_kernels_defaults.log" 2>&1
stamp "kernel tests rc $?"; tail -n 3 "$OUT/gpu_kernels_defaults.log"
