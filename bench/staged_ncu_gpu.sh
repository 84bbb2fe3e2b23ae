#!/bin/bash
# One device call (issue 13, 2026-12-05, second session): Nsight Compute on the staged regime at
# Mixtral-8x7B size, 256 tokens, 4 bits (the one prefill target still missed), both projections of
# the fourth layer call (three warm-up calls skipped), details page of the full set, plus the
# per-instruction warp-stall samples (source page CSV) that bench/ncu_stall_table.py reads.
# STAGED_WIDE=16 (or 0) sets STAGED_WIDE_NT8: passes of 128 tokens (or none) whatever the default.
# Carry kernel_cache/ from a previous call of the same source to skip the compiles.
# APL_KERNEL_DEFINES (e.g. APL_STAGED_TMA=1) sets knobs; TAG (e.g. _tma) names the outputs apart.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [STAGED_WIDE=16] [TOKENS=256] [BITS=4] [TAG=_x] bash bench/staged_ncu_gpu.sh
. "$(dirname "$0")/device_call.sh"
command -v ncu > /dev/null || { stamp "no ncu"; exit 1; }
tag=mixtral_t${TOKENS:-256}_b${BITS:-4}${STAGED_WIDE:+_wide$STAGED_WIDE}${TAG:-}
rep=/tmp/ncu_staged_$tag
timeout -k 10 "${NCU_TIMEOUT_S:-240}" ncu --clock-control none --kernel-name regex:apl_staged --launch-skip 6 \
  --launch-count 2 --set full --import-source no -f -o "$rep" \
  python3 bench/profile_apl_moe.py --model mixtral-8x7b --tokens "${TOKENS:-256}" --bits "${BITS:-4}" \
  ${STAGED_WIDE:+--staged-wide "$STAGED_WIDE"} > "$OUT/ncu_staged_$tag.log" 2>&1
stamp "ncu rc $?"; tail -n 3 "$OUT/ncu_staged_$tag.log"
ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_staged_${tag}_details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > /tmp/sass.csv 2>&1 \
  && gzip -c /tmp/sass.csv > "$OUT/ncu_staged_${tag}_sass.csv.gz"
stamp "pages written"
grep -E "apl_staged|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Shared Memory Configuration Size" \
  "$OUT/ncu_staged_${tag}_details.txt" | sed 's/  */ /g' | head -n 40
