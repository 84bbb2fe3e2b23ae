#!/usr/bin/env bash
# One GPU call for issue 12's prefill graphs (run from the repository root on the H200):
#  1. bench/real_shape.py at the Qwen1.5-MoE shape, bf16 dense and static-4, each in two
#     modes of the same engine: graphs-eager-prefill (decode steps replay graphs, prefill
#     steps run eagerly: the engine before this change) and graphs-inplace (every step,
#     prefill chunks included, replays a token-row graph); concurrency 1 and 16, TTFT 512,
#     the first step of a 32-token request profiled in both modes, and every replayed
#     prefill step's logits against the eager step (prefill_parity);
#  2. the CUDA tests of the decode graphs (prefill rows included) with the time left.
# Results to $OUT (default bench/results/). CALL_S bounds the whole call.
set -u
OUT=$(cd "${OUT:-bench/results}" && pwd)
TAG=${TAG:-prefill}
CALL_S=${CALL_S:-210}
export PYTHONUNBUFFERED=1 PYTHONPATH=.:services:kernels
# the static-4 runtime build alone took 62.7 s on the H200 (2026-12-01): with BENCH_S=115 no
# static-4 load ran (the run reached 121.9 s); both decoders need about 150 (an estimate)
LIMIT=${BENCH_S:-150}
PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown} PAGEDWEIGHT_CODE_COMMIT=${CODE_COMMIT:-unknown} \
  timeout $(( LIMIT + 15 )) python3 -m bench.real_shape --model qwen1.5-moe-a2.7b \
  --modes graphs-eager-prefill graphs-inplace --skip hf pressure --static-bits 4 --concurrency 1 16 \
  --min-requests 6 --ttft-prompts 512 --profile-concurrency ${PROFILE_C:-} --prefill-profile 32 \
  --time-limit-s $LIMIT --reserve-s 8 --label "$TAG" \
  --out "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_$TAG.json" > "$OUT/real_shape_$TAG.log" 2>&1
tail -n 3 "$OUT/real_shape_$TAG.log"
left=$(( CALL_S - SECONDS - 5 ))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_decode_graphs.py \
    > "$OUT/gpu_tests_$TAG.log" 2>&1
  tail -n 5 "$OUT/gpu_tests_$TAG.log"
else
  echo "no time left for the GPU tests ($left s)"
fi
python3 bench/real_shape_summary.py "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_$TAG.json"
python3 - "$OUT/real_shape_qwen1.5-moe-a2.7b_cuda_$TAG.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = {f"bf16 {m}": v for m, v in (d.get("engine_bf16_dense") or {}).items()}
for m, v in ((d.get("runtime_static") or {}).get("static-4", {}).get("by_mode") or {}).items():
    rows[f"static-4 {m}"] = v
for name, v in rows.items():
    p = (v.get("prefill") or {}).get("32", {})
    print(name, "prefill32:", {k: p.get(k) for k in ("step_ms", "replayed", "kernels_per_step", "kernel_ms_per_step")},
          "host", p.get("host_phase_ms"), "ttft", v.get("ttft_s"))
    par = v.get("prefill_parity")
    if par:
        print("   parity:", [(c["rows"], round(c["rel_err"], 5), c["argmax_agree"]) for c in par])
PY
