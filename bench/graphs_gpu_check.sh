#!/bin/bash
# One device call for what 2026-12-01's last session changed in the CUDA-graph path and could
# not run on a GPU: the decode graphs' shared logits buffer (171f140), prompt routing recorded
# inside the graphs (9691aea) and the shared expert's side stream; then the production path's
# prompt steps (a PromptRoutingRecorder installed), before (prefill eager, as the recorder used
# to force) and after, at the Qwen1.5-MoE shape. Outputs under $OUT; about 4 minutes.
# Usage (device): OUT=$OUT CODE_COMMIT=<commit> bash bench/graphs_gpu_check.sh
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1
OUT=$(cd "${OUT:-bench/results}" && pwd)
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# TESTS=paths: the whole of `make test-gpu-paths` (every GPU test outside tests/kernels, the
# three files above among them), else only those three files.
if [ "${TESTS:-three}" = paths ]; then
  targets=(tests --ignore=tests/kernels --ignore=tests/cli --ignore=tests/e2e --ignore=tests/gateway
           --ignore=tests/worker --ignore=tests/planner_service --ignore=tests/rpc --ignore=tests/fuzz
           --ignore=tests/test_prompt_residuals_online.py)
else
  targets=(tests/engine/test_decode_graphs.py tests/engine/test_prompt_routing.py tests/model/test_shared_expert_overlap.py)
fi
timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short --durations=15 \
  "${targets[@]}" > "$OUT/gpu_graphs_check.log" 2>&1
stamp "tests rc $?"; tail -n 4 "$OUT/gpu_graphs_check.log"
PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown} \
  timeout 170 python3 -m bench.real_shape --model qwen1.5-moe-a2.7b \
  --modes graphs-eager-prefill-prompts graphs-overlap-prompts --skip hf pressure --static-bits 4 \
  --concurrency 1 16 --min-requests 6 --ttft-prompts 512 --prefill-profile 32 --profile-concurrency \
  --time-limit-s 160 --reserve-s 8 --label prompts \
  --out "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_prompts.json" > "$OUT/real_shape_prompts.log" 2>&1
stamp "bench rc $?"
python3 bench/real_shape_summary.py "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_prompts.json"
