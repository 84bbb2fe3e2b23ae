#!/usr/bin/env bash
# quality14's one H200 call: the Qwen shape at 4 layers with the new default (8,192 tokens),
# then the quantiser's parts at real shapes. Logs into $OUT/run.log.
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1
OUT=$OUT CALIB=2048 LAYERS=4 DEADLINE_S=110 NAME=quantize_full_depth_qwen_4l_new_default \
    bash bench/quantize_full_depth.sh >> "$LOG" 2>&1
echo "full depth rc=$?" >> "$LOG"
timeout 50 python3 -m bench.quantize_parts --model Qwen1.5-MoE-A2.7B --skip default_grouped_float32 \
    --copy-to "$OUT" >> "$LOG" 2>&1
echo "parts qwen rc=$?" >> "$LOG"
timeout 30 python3 -m bench.quantize_parts --model Mixtral-8x7B --experts 2 \
    --skip kmeans_only default_per_tile_feedback default_grouped_float32 --copy-to "$OUT" >> "$LOG" 2>&1
echo "parts mixtral rc=$?" >> "$LOG"
tail -30 "$LOG"
