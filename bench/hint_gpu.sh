#!/bin/bash
# One device call (issue 13, 2026-12-03, second session): the plane words' cache qualifiers
# (APL_PLANE_HINT: L1::no_allocate, L2::256B / 128B prefetch sizes) at decode and in the tiles regime,
# the same under stable launches (the merged kernel at any bits, what the elastic runtime serves),
# and the 5-8-bit and merged kernels' down launched programmatically with their shared LUT rows
# filled after the wait (pdl_merged), in one process with the mixed layers' byte-weighted times;
# then Nsight Compute's warp-state and instruction summaries of one Mixtral-size 1-token 4-bit
# layer call, the 3-4-bit kernel against the stable launch (where the merged kernel's 3-4-bit
# path loses its time).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [VARIANTS="..."] [SKIP_NCU=1] bash bench/hint_gpu.sh
. "$(dirname "$0")/device_call.sh"
VARIANTS=${VARIANTS:-base hint_1 hint_2 hint_3 hint_5 stable stable_hint_1 stable_hint_3 pdl_merged stable_pdl_merged}
timeout "${VARIANTS_TIMEOUT_S:-360}" python3 -m bench.apl_gemv_variants $VARIANTS --hint --json apl_gemv_hint \
  > "$OUT/apl_gemv_hint.log" 2>&1
stamp "variants rc $?"; cp bench/results/apl_gemv_hint.json "$OUT/" 2>/dev/null
# the tail: one line per shape, the variants' times side by side
python3 - "$OUT/apl_gemv_hint.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
variants = list(dict.fromkeys(r["variant"] for r in rows))
table = {}
for r in rows:
    table.setdefault((r["model"][:3], r["tokens"], r["bits"]), {})[r["variant"]] = r
print("shape", *variants)
for (m, T, b), by in table.items():
    if len(by) < 2:
        continue
    cells = [f'{by[v]["us"]:.1f}' + (f'({by[v]["over_byte_weighted"]:.2f})' if "over_byte_weighted" in by[v] else "")
             if v in by else "-" for v in variants]
    print(f"{m}{T}/{b}", *cells)
PY
[ -n "${SKIP_NCU:-}" ] && exit 0
if command -v ncu > /dev/null; then
  for mode in base stable; do
    flag=$([ $mode = stable ] && echo --stable)
    timeout 90 ncu --clock-control none --kernel-name regex:apl_gemv --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section InstructionStats --section MemoryWorkloadAnalysis -f -o /tmp/ncu_$mode \
      python3 bench/profile_apl_moe.py --model mixtral-8x7b --tokens 1 --bits 4 $flag > /tmp/ncu_$mode.log 2>&1
    stamp "ncu $mode rc $?"
    ncu -i /tmp/ncu_$mode.ncu-rep --page details > "$OUT/ncu_mixtral_t1_b4_${mode}_hint.txt" 2>&1
    grep -E "apl_gemv|Duration|Stall|Warp Cycles Per Issued|L1/TEX Hit|Achieved Occupancy|Shared Memory Configuration Size|Executed Ipc A" \
      "$OUT/ncu_mixtral_t1_b4_${mode}_hint.txt" | sed 's/  */ /g' | cut -c1-110 | head -40
  done
else
  stamp "no ncu"
fi
