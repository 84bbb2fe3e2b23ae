#!/bin/bash
# One device call (issue 13, 2026-12-05, third session): the staged regime's activations by TMA
# (APL_STAGED_TMA: one tensor-map box a step into 128-byte-swizzled B tiles, in place of the
# producers' 16-byte cp.async copies). Steps, each skipped where its variable is "none":
#   1. every instance at the default knobs (precompile, in threads) and the staged instances with
#      APL_STAGED_TMA flipped (plus moe_gather_rows; FLIPPED=0: not), so later steps compile nothing;
#   2. BITS_K: the GPU tests that flip APL_STAGED_TMA against the default, bit for bit;
#   3. VARIANTS at SHAPES (bench.apl_gemv_variants --staged --only-shapes), one process;
#   4. SUITE_K: the staged GPU tests with APL_STAGED_TMA flipped for the whole process;
#   5. EXTRA: more GPU tests at the default knobs (pytest paths; EXTRA_K selects);
#   6. LAYER=1: the layer benchmark (bf16 grouped_mm beside it), with the flipped default, or with
#      LAYER_FLIP=0 at the default (LAYER_BITS, LAYER_TOKENS).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/staged_tma_gpu.sh
. "$(dirname "$0")/device_call.sh"
flip=$(python3 -c "import pagedweight_kernels.apl_moe as op; print(0 if op.KERNEL_DEFINES['APL_STAGED_TMA'] else 2)")
if [ "${PRECOMPILE:-1}" != none ]; then
  APL_STAGED_PREFILL=1 timeout -k 10 "${COMPILE_TIMEOUT_S:-220}" python3 - "$flip" "${FLIPPED:-1}" <<'PY'
import sys
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import torch

import pagedweight_kernels.apl_moe as op

print("default", op.precompile(torch.bfloat16, max_workers=16), op.precompile(torch.float16, max_workers=16), flush=True)
if sys.argv[2] == "0":  # (FLIPPED=0: no later step runs the flipped knob)
    sys.exit(0)
op.KERNEL_DEFINES["APL_STAGED_TMA"] = int(sys.argv[1])
todo = [(name, op._defines(act)) for dtype in (torch.bfloat16, torch.float16) for name, act in op.kernel_instances(dtype)
        if name.startswith(("apl_staged<", "moe_gather_rows"))]


def one(key):
    with cp.cuda.Device(0):
        op._compiled(*key)


with ThreadPoolExecutor(16) as pool:
    list(pool.map(one, todo))
print("flipped", len(todo), flush=True)
PY
  stamp "precompile rc $?"
fi
if [ "${BITS_K:-tma_activations or TMA}" != none ]; then
  gpu_pytest gpu_staged_tma_bits.log "${BITS_TIMEOUT_S:-150}" tests/kernels/test_apl_staged_gpu.py -k "${BITS_K:-tma_activations or TMA}"
  stamp "bit-for-bit tests rc $?"; tail -n 25 "$OUT/gpu_staged_tma_bits.log" | grep -v "^$" | tail -n 15
fi
if [ "${VARIANTS:-base staged_tma}" != none ]; then
  staged_variants apl_gemv_staged_tma "${VARIANTS_TIMEOUT_S:-160}" \
    "${SHAPES:-mixtral-8x7b:256:4,mixtral-8x7b:256:3,mixtral-8x7b:128:4,mixtral-8x7b:512:4,qwen1.5-moe-a2.7b:64:4,qwen1.5-moe-a2.7b:256:4,qwen1.5-moe-a2.7b:1024:4}" \
    ${VARIANTS:-base staged_tma}
  stamp "variants rc $?"
  python3 -m bench.variants_table "$OUT/apl_gemv_staged_tma.json"
fi
if [ "${SUITE_K:-not knobs and not units_of_4 and not ring_of_two and not tma_activations}" != none ]; then
  APL_KERNEL_DEFINES=APL_STAGED_TMA=$flip gpu_pytest gpu_staged_tma_suite.log "${SUITE_TIMEOUT_S:-150}" tests/kernels/test_apl_staged_gpu.py \
    -k "${SUITE_K:-not knobs and not units_of_4 and not ring_of_two and not tma_activations}"
  stamp "suite with APL_STAGED_TMA=$flip rc $?"; tail -n 25 "$OUT/gpu_staged_tma_suite.log" | grep -v "^$" | tail -n 15
fi
if [ -n "${EXTRA:-}" ]; then  # more GPU tests at the default knobs: pytest arguments
  gpu_pytest gpu_extra_tests.log "${EXTRA_TIMEOUT_S:-150}" $EXTRA ${EXTRA_K:+-k "$EXTRA_K"}
  stamp "extra tests rc $?"; tail -n 25 "$OUT/gpu_extra_tests.log" | grep -v "^$" | tail -n 12
fi
if [ -n "${LAYER:-}" ]; then
  [ "${LAYER_FLIP:-1}" = 1 ] && export APL_KERNEL_DEFINES=APL_STAGED_TMA=$flip
  layer_bench apl_moe_kernel_staged_tma "${BENCH_TIMEOUT_S:-150}" --tokens ${LAYER_TOKENS:-64 256} --bits ${LAYER_BITS:-3 4}
  stamp "layer bench rc $?"; grep -E "T=|copy" "$OUT/apl_moe_kernel_staged_tma.log" | sed 's/  */ /g'
fi
