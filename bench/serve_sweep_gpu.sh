#!/usr/bin/env bash
# The cluster benchmark on a GPU machine: in-process AsyncEngine, the worker's
# GenerateStream and the gateway's HTTP side by side at c16, c64, c256, 30 s a point
# (bench/serve_sweep.py), JSON under $OUT with commit, date and GPU.
#
#   MODEL=PAGED_DIR bench/serve_sweep_gpu.sh      (default: micro-mixtral, quantised here first)
#
# The GPU image has no fastapi/uvicorn/pydantic/redis/grpcio-health-checking: fetch them as
# wheels once on a machine with pip (`bench/serve_sweep_gpu.sh --wheels`, into .whl/, about
# 12 MB, the versions `make setup` installs) and carry .whl in the device call; this script
# installs them into /tmp/site.
set -u
if [ "${1:-}" = "--wheels" ]; then
  mkdir -p .whl
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2> /dev/null || echo /.whl/ >> "$exclude"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 redis==8.2.0 grpcio==1.85.4 grpcio-health-checking==1.85.1 \
    protobuf==7.36.2
  exit
fi
. bench/device_call.sh
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
  MODEL=/tmp/micro-mixtral-paged
  stamp "quantising models/micro-mixtral into $MODEL"
  python3 -m pagedweight.cli.main quantize --model models/micro-mixtral --out "$MODEL" --calib data/sample.txt \
    --device cuda > "$OUT/quantize.log" 2>&1 || { tail -20 "$OUT/quantize.log"; exit 1; }
fi
stamp "sweep on $MODEL"
python3 -m bench.serve_load --mode sweep --model "$MODEL" --device cuda --memory-budget "${BUDGET:-0.85}" \
  --concurrency "${LEVELS:-16,64,256}" --duration "${DURATION:-30}" --prompt-len "${PROMPT_LEN:-32:128}" \
  --output-len "${OUTPUT_LEN:-128:256}" --threads 4 --out "$OUT/serve_sweep.json" 2>&1 | tee "$OUT/serve_sweep.log" \
  | grep -v '^\[\(planner\|worker\|gateway\)\]'
stamp done
