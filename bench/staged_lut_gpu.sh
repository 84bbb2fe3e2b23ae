#!/bin/bash
# One device call (issue 13, 2026-12-05, fourth session): the 5-8-bit producers of the staged regime
# (apl_staged.cu: APL_STAGED_LUT_LANES, APL_STAGED_PREFETCH_LUT, APL_STAGED_TMA 2). Steps, each skipped
# where its variable is "none":
#   1. every instance at the default knobs with the staged regime for every class (precompile), and
#      the staged instances of every class (bf16) at each KNOB_SETS entry, in threads;
#   2. TESTS: GPU tests (pytest paths; TESTS_K selects);
#   3. VARIANTS at SHAPES (bench.apl_gemv_variants --staged --only-shapes), one process.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/staged_lut_gpu.sh
. "$(dirname "$0")/device_call.sh"
if [ "${PRECOMPILE:-1}" != none ]; then
  APL_STAGED_PREFILL=1 timeout -k 10 "${COMPILE_TIMEOUT_S:-240}" python3 - "${KNOB_SETS:-APL_STAGED_LUT_LANES=1;APL_STAGED_LUT_LANES=1,APL_STAGED_PREFETCH_LUT=2;APL_STAGED_TMA=2;APL_STAGED_LUT_LANES=1,APL_STAGED_TMA=2;APL_STAGED_LUT_LANES=1,APL_STAGED_PREFETCH_LUT=2,APL_STAGED_TMA=2}" <<'PY'
import sys
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import torch

import pagedweight_kernels.apl_moe as op

print("default", op.precompile(torch.bfloat16, max_workers=16), flush=True)
base = dict(op.KERNEL_DEFINES)
op.STAGED_LUT_WIDE_NT8 = 16  # (the 128-token passes' instances too)
todo = []
for knobs in filter(None, sys.argv[1].split(";")):
    overrides = op.knob_overrides(knobs)
    op.KERNEL_DEFINES.clear()
    op.KERNEL_DEFINES.update(base, **overrides)
    todo += [(name, op._defines(act)) for name, act in op.kernel_instances(torch.bfloat16)
             if name.startswith(("apl_staged<1", "apl_staged<2", "moe_gather_rows"))]


def one(key):
    with cp.cuda.Device(0):
        op._compiled(*key)


with ThreadPoolExecutor(16) as pool:
    list(pool.map(one, todo))
print("knob sets", len(todo), flush=True)
PY
  stamp "precompile rc $?"
fi
if [ "${TESTS:-tests/kernels/test_apl_staged_gpu.py}" != none ]; then
  gpu_pytest gpu_staged_lut_tests.log "${TESTS_TIMEOUT_S:-150}" ${TESTS:-tests/kernels/test_apl_staged_gpu.py} -k "${TESTS_K:-lut_row_knobs}"
  stamp "tests rc $?"; tail -n 25 "$OUT/gpu_staged_lut_tests.log" | grep -v "^$" | tail -n 12
fi
if [ "${VARIANTS:-base staged_tma_all staged_lanes staged_lanes_p2 staged_lanes_tma2 staged_lanes_p2_tma2}" != none ]; then
  staged_variants "${JSON:-apl_gemv_staged_lut}" "${VARIANTS_TIMEOUT_S:-300}" \
    "${SHAPES:-mixtral-8x7b:256:8,mixtral-8x7b:64:8,qwen1.5-moe-a2.7b:256:8,qwen1.5-moe-a2.7b:64:8,mixtral-8x7b:256:mixed,qwen1.5-moe-a2.7b:256:mixed}" \
    ${VARIANTS:-base staged_tma_all staged_lanes staged_lanes_p2 staged_lanes_tma2 staged_lanes_p2_tma2}
  stamp "variants rc $?"
  python3 -m bench.variants_table "$OUT/${JSON:-apl_gemv_staged_lut}.json"
fi
