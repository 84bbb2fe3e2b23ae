#!/usr/bin/env bash
# Per-layer forward / quantise / backward times of the streaming quantiser at the
# Qwen1.5-MoE-A2.7B shape and the default calibration size (65,536 tokens), after and
# before this branch's changes, in one GPU command (bench/quantize_layer_speed.py).
# Run from a folder holding services/, kernels/, bench/ (after) and before/ (the same
# three folders at the base commit):
#   OUT=/tmp/out AFTER=<sha> BEFORE=<sha> bash bench/quantize_layer_speed_device.sh
# One 3-layer checkpoint in /dev/shm serves both runs; "after" runs its 3 layers with
# torch.profiler tables of the last layer's forward and backward steps, "before" its first
# layer (the session's device time: 259 s with the machine's start). Every step rewrites
# the run's JSON, so a run cut off by its timeout keeps what it measured. The profiled
# forward step took "after" past its 90 s on the H200 (2026-12-01): drop --profile, or give
# it its own call, to measure the backward steps.
set -uo pipefail
OUT=${OUT:?the folder for the results}
TOKENS=${TOKENS:-65536}
MODEL=${MODEL:-Qwen1.5-MoE-A2.7B}  # qwen-scaled with DEVICE=cpu: a dry run of this script
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1
SHM=/dev/shm/pagedweight-layer-speed
rm -rf "$SHM"
mkdir -p "$SHM"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

PYTHONPATH=.:services:kernels timeout 35 python3 -c "
import sys, time, torch
from pathlib import Path
from bench.quantize_stream import build_checkpoint
t = time.perf_counter()
build_checkpoint('$MODEL', 3, Path('$SHM/ckpt'), torch.device('$DEVICE'))
print(f'built 3 layers in {time.perf_counter() - t:.1f} s', file=sys.stderr)
" 2>&1 | tail -3 | tee "$OUT/build.log"
echo "build done at $((SECONDS - start)) s"

PAGEDWEIGHT_COMMIT=${AFTER:-unknown} PYTHONPATH=.:services:kernels timeout 90 \
    python3 -m bench.quantize_layer_speed --model "$MODEL" --tokens "$TOKENS" --device "$DEVICE" \
    --checkpoint "$SHM/ckpt" --work-dir "$SHM/work-after" --label after --profile \
    --name quantize_layer_speed_after --copy-to "$OUT" 2>&1 | grep -v "^USDT\|profiler_st" | tail -20
echo "after done at $((SECONDS - start)) s"
rm -rf "$SHM/work-after"

(cd before && PAGEDWEIGHT_COMMIT=${BEFORE:-unknown} PYTHONPATH=.:services:kernels timeout 60 \
    python3 -m bench.quantize_layer_speed --model "$MODEL" --tokens "$TOKENS" --device "$DEVICE" \
    --checkpoint "$SHM/ckpt" --work-dir "$SHM/work-before" --label before --run-layers 1 \
    --name quantize_layer_speed_before --copy-to "$OUT" 2>&1 | tail -12)
echo "before done at $((SECONDS - start)) s"
rm -rf "$SHM"
