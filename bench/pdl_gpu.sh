#!/bin/bash
# One device call (issue 13, 2026-12-02, third session): programmatic dependent launch of the
# projections (GEMV_PDL, APL_GEMV_PDL) and the stable-launch lead (GEMV_SHARED_PAD), in one
# process per table: a smoke test of the programmatic launch first, then
#   base pdl_code pdl pdl_all pdl_prefetch --compact   (Qwen1.5-MoE 1-4 tokens, Mixtral 1-4 tokens)
#   base pdl pdl_all --tiles                            (64 and 256 tokens)
#   base shared_pad stable --merged                     (the merged kernel's shapes)
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/pdl_gpu.sh
. "$(dirname "$0")/device_call.sh"
t=tests/kernels/test_apl_pdl_gpu.py::test_programmatic_launches_equal_serial_launches
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  "$t[8-2-160-224-1-8-bfloat16-None-1]" "$t[60-4-2048-1408-4-60-bfloat16-4-2]" > "$OUT/pdl_smoke.log" 2>&1
stamp "smoke rc $?: $(tail -n 1 "$OUT/pdl_smoke.log")"
run_variants() {  # json name, time limit, then the variants' arguments
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m bench.apl_gemv_variants "$@" --json "$name" > "/tmp/$name.log" 2>&1
  stamp "$name rc $?"; grep " us$" "/tmp/$name.log" | sed 's/  */ /g'
  cp "bench/results/$name.json" "$OUT/" 2>/dev/null
}
run_variants apl_gemv_pdl "${PDL_TIMEOUT_S:-200}" base pdl_code pdl pdl_all pdl_prefetch --compact
run_variants apl_gemv_stable_pad "${PAD_TIMEOUT_S:-110}" base shared_pad stable --merged
run_variants apl_gemv_pdl_tiles "${TILES_TIMEOUT_S:-110}" base pdl pdl_all --tiles
