#!/bin/bash
# One device call (issue 13, second): decode code-size and split variants against the two-launch
# baseline and the fused launch, then the compact-loop equality tests. Outputs under $OUT.
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
timeout 55 python3 -m bench.apl_gemv_variants unfused compact fused fused_compact compact_split8 unfused_t352 \
  --compact --json apl_gemv_compact_variants > "$OUT/bench.log" 2>&1
stamp "bench rc $?"; cp bench/results/apl_gemv_compact_variants.json "$OUT/" 2>/dev/null
timeout 30 python3 -m pytest -q -p no:cacheprovider -k "compact_decode_loop" tests/kernels/test_apl_moe_gpu.py > "$OUT/tests.log" 2>&1
stamp "tests rc $?"
tail -2 "$OUT/tests.log"; grep " us$" "$OUT/bench.log"
