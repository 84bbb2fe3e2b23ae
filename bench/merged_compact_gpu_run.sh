#!/bin/bash
# One device call (issue 13, third): APL_GEMV_COMPACT per class (default 4: the merged kernel)
# against no compact loop, on the merged kernel's shapes (mixed bits; 4 bits with stable
# launches), then the compact-loop equality tests (classes 0 and 2). Outputs under $OUT.
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
timeout 40 python3 -m bench.apl_gemv_variants base no_compact stable no_compact_stable --merged \
  --json apl_gemv_merged_compact > "$OUT/bench.log" 2>&1
stamp "bench rc $?"; cp bench/results/apl_gemv_merged_compact.json "$OUT/" 2>/dev/null
timeout 35 python3 -m pytest -q -p no:cacheprovider -k "compact_decode_loop" tests/kernels/test_apl_moe_gpu.py > "$OUT/tests.log" 2>&1
stamp "tests rc $?"
tail -2 "$OUT/tests.log"; grep " us$" "$OUT/bench.log"
