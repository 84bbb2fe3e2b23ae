#!/bin/bash
# One device call at the defaults: the layer benchmark at every width the mixed
# layer draws (3, 4, 5, 6, 8) and mixed, so the mixed layer's byte-weighted time is measured
# (add_byte_weighted), then every GPU test outside tests/kernels (make test-gpu-paths: the
# engine, graphs and models on the kernel), then the engine at the Qwen1.5-MoE shape
# (bench/real_shape.py, production path, bf16 and static-4, concurrency 1, 16, 64).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/decode_widths_gpu.sh
. "$(dirname "$0")/device_call.sh"
export PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown}
timeout 120 python3 -m bench.apl_moe_kernel --tokens 1 4 16 --bits 3 4 5 6 8 mixed --no-per-block --no-legacy \
  --name apl_moe_kernel_widths > "$OUT/apl_moe_kernel_widths.log" 2>&1
stamp "layer bench rc $?"; grep "T=" "$OUT/apl_moe_kernel_widths.log" | cut -c1-60,100-200
cp bench/results/apl_moe_kernel_widths.json "$OUT/" 2>/dev/null
PYTEST_ADDOPTS="-p no:cacheprovider -rfE --tb=short" timeout "${TEST_TIMEOUT_S:-230}" make test-gpu-paths \
  > "$OUT/gpu_paths_defaults.log" 2>&1  # (the Makefile's selection, not a copy of its ignore list)
stamp "test-gpu-paths rc $?"; tail -n 4 "$OUT/gpu_paths_defaults.log"
left=$(( ${BUDGET_S:-540} - ($(date +%s) - t0) ))
timeout "$left" python3 -m bench.real_shape --model qwen1.5-moe-a2.7b --modes graphs-overlap-prompts --skip hf pressure \
  --static-bits 4 --concurrency 1 16 64 --min-requests 6 --time-limit-s $(( left - 10 )) --reserve-s 8 --label acqrel_fma \
  --out "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_acqrel_fma.json" > "$OUT/real_shape_acqrel_fma.log" 2>&1
stamp "real_shape rc $?"; grep -iE "tok/s|floor|c=|concurrency" "$OUT/real_shape_acqrel_fma.log" | tail -n 20
