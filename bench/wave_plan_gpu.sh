#!/bin/bash
# One device call (issue 13): the decode kernel's whole-wave column splits (_wave_splits)
# against the earlier rule in the same process, the 1-token layer against bf16 grouped_mm,
# and the kernel's GPU tests on the new plans. Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/wave_plan_gpu.sh
. "$(dirname "$0")/device_call.sh"
timeout 200 python3 -m bench.apl_gemv_variants base no_wave --waves --json apl_gemv_waves > "$OUT/apl_gemv_waves.log" 2>&1
stamp "variants rc $?"; cat "$OUT/apl_gemv_waves.log" | grep " us$"
cp bench/results/apl_gemv_waves.json "$OUT/" 2>/dev/null
timeout 100 python3 -m bench.apl_moe_kernel --tokens 1 4 --bits 3 4 --no-per-block --no-legacy --name apl_moe_kernel_waves \
  > "$OUT/apl_moe_kernel_waves.log" 2>&1
stamp "layer bench rc $?"; grep "T=" "$OUT/apl_moe_kernel_waves.log"
cp bench/results/apl_moe_kernel_waves.json "$OUT/" 2>/dev/null
timeout "${TEST_TIMEOUT_S:-220}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_apl_moe_gpu.py > "$OUT/gpu_kernels_waves.log" 2>&1
stamp "kernel tests rc $?"; tail -n 3 "$OUT/gpu_kernels_waves.log"
