#!/usr/bin/env bash
# One GPU call for issue 12's per-step work (run from the repository root on the H200):
#  1. the CUDA tests of what the step changed (graphs against eager, per-step KV indices,
#     the fewer-launch norm / RoPE / qkv, the decode kernel, fused-kernel replays);
#  2. bench/real_shape.py on this tree ("after") and, with the same script, on the tree
#     at $BASE_DIR ("before": services/ and kernels/ of the base commit, bench/ of this
#     one, which leaves out the profile fields an older engine has not got);
#  3. the Mixtral-8x7B shape at concurrency 1, 4 bits (and bf16 dense unless MIXTRAL_SKIP
#     names bf16), while time is left.
# With GEMV_BENCH=1, first bench/expert_gemv.py: its measured crossover (assignments per
# expert, the lower of its shapes') becomes the expert GEMV's limit of every real_shape run
# below (--gemv-tokens-per-expert).
# Results and logs go to $OUT (default bench/results/). Usage:
#   BASE_DIR=.base BASE_COMMIT=8696dd6 CODE_COMMIT=<HEAD> TAG=step bash bench/real_shape_before_after.sh
# TAG names the result files (real_shape_<model>_cuda_<TAG>_{after,before}.json, ...).
set -u
OUT=$(cd "${OUT:-bench/results}" && pwd)  # absolute: the "before" run works from $BASE_DIR
BASE_DIR=${BASE_DIR:-.base}
TAG=${TAG:-step}
export PYTHONUNBUFFERED=1
GEMV_ARGS=""
if [ -n "${GEMV_BENCH:-}" ]; then
  PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PYTHONPATH=.:services:kernels timeout ${GEMV_S:-60} \
    python3 -m bench.expert_gemv --out "$OUT/expert_gemv_$TAG.json" > "$OUT/expert_gemv_$TAG.log" 2>&1
  tail -n 24 "$OUT/expert_gemv_$TAG.log"
  GEMV_MAX=$(python3 -c "import json; print(json.load(open('$OUT/expert_gemv_$TAG.json'))['gemv_faster_up_to_tokens_per_expert'])" 2>/dev/null)
  [ -n "$GEMV_MAX" ] && GEMV_ARGS="--gemv-tokens-per-expert $GEMV_MAX"
  echo "expert GEMV limit (tokens per expert) for the runs below: ${GEMV_MAX:-the default in the code}"
fi
QWEN_ARGS="$GEMV_ARGS --model qwen1.5-moe-a2.7b --modes graphs-inplace --skip hf pressure --static-bits 4
  --concurrency 1 16 64 --ttft-prompts 512 --profile-concurrency ${QWEN_PROFILE:-1 64} --time-limit-s ${QWEN_LIMIT_S:-140}
  --reserve-s 20"

PYTHONPATH=.:services:kernels timeout ${TESTS_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${GPU_TESTS:-tests/engine/test_decode_graphs.py tests/memory/test_kv_blocks.py tests/model/test_cuda_decode_ops.py \
  tests/model/test_paged_decode.py tests/weights/test_arena_graph_gpu.py tests/engine/test_engine_gpu.py} \
  > "$OUT/speed12_gpu_tests_$TAG.log" 2>&1
tail -n 3 "$OUT/speed12_gpu_tests_$TAG.log"

PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown} \
  PYTHONPATH=.:services:kernels timeout $(( ${QWEN_LIMIT_S:-140} + 20 )) python3 -m bench.real_shape $QWEN_ARGS --label after \
  --out "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_${TAG}_after.json" > "$OUT/real_shape_${TAG}_after.log" 2>&1
tail -n 2 "$OUT/real_shape_${TAG}_after.log"

if [ -d "$BASE_DIR/services" ]; then
  (cd "$BASE_DIR" && PAGEDWEIGHT_COMMIT=${BASE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${BASE_COMMIT:-unknown} \
    PYTHONPATH=.:services:kernels timeout $(( ${QWEN_LIMIT_S:-140} + 20 )) python3 -m bench.real_shape $QWEN_ARGS --label before \
    --out "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_${TAG}_before.json") > "$OUT/real_shape_${TAG}_before.log" 2>&1
  tail -n 2 "$OUT/real_shape_${TAG}_before.log"
fi

# the Mixtral shape only with the time it needs (~130 s) inside the call's limit ($CALL_S)
left=$(( ${CALL_S:-300} - SECONDS - 10 ))
[ "$left" -gt 120 ] && PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown} \
  PYTHONPATH=.:services:kernels timeout "$left" python3 -m bench.real_shape $GEMV_ARGS --model mixtral-8x7b \
  --skip ${MIXTRAL_SKIP:-hf bf16 pressure} --static-bits 4 --concurrency 1 --ttft-prompts --profile-concurrency 1 --kv-gib 2 \
  --modes graphs-inplace --time-limit-s "$left" --reserve-s 10 --label after \
  --out "$OUT/real_shape_mixtral-8x7b_cuda_$TAG.json" > "$OUT/real_shape_mixtral_$TAG.log" 2>&1
tail -n 2 "$OUT/real_shape_mixtral_$TAG.log"
python3 bench/real_shape_summary.py "$OUT"/real_shape_*_"$TAG"*.json | tee "$OUT/real_shape_${TAG}_summary.txt"
