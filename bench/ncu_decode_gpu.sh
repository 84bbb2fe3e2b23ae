#!/bin/bash
# Nsight Compute on one layer call per model (1 token, 4 bits: decode; TOKENS=256: the tiles
# regime, on wgmma at the defaults), at the current defaults: the details page and the per-SASS
# warp-stall samples (bench/ncu_stall_table.py reads the CSV). The stalls section of
# bench/kernel_stalls_gpu.sh, alone, for a re-read after a change.
# Usage (device): OUT=$OUT TAG=<name> [TOKENS=1] [MODELS="mixtral-8x7b qwen1.5-moe-a2.7b"] bash bench/ncu_decode_gpu.sh
. "$(dirname "$0")/device_call.sh"
TAG=${TAG:-defaults}
T=${TOKENS:-1}
command -v ncu > /dev/null || { stamp "no ncu"; exit 2; }
for model in ${MODELS:-mixtral-8x7b qwen1.5-moe-a2.7b}; do
  rep=/tmp/ncu_$model
  timeout "${NCU_TIMEOUT_S:-100}" ncu --clock-control none --kernel-name regex:apl_ --launch-skip 6 --launch-count 2 \
    --set full --import-source no -f -o "$rep" \
    python3 bench/profile_apl_moe.py --model "$model" --tokens "$T" --bits 4 > "/tmp/ncu_$model.log" 2>&1
  stamp "ncu $model rc $?"; tail -n 2 "/tmp/ncu_$model.log"
  ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_${model}_t${T}_b4_details_$TAG.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${model}_t${T}_b4_sass_$TAG.csv" 2>&1 \
    && gzip -f "$OUT/ncu_${model}_t${T}_b4_sass_$TAG.csv"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|ALU" "$OUT/ncu_${model}_t${T}_b4_details_$TAG.txt" | head -n 20
done
