#!/usr/bin/env bash
# The serving sweep on a GPU machine (`python -m bench run serve-sweep`: in-process AsyncEngine,
# the worker's GenerateStream and the gateway's HTTP side by side at c16, c64, c256), with the
# gateway's packages, which the GPU image lacks, installed from wheels carried in the call.
#
#   bash tools/serve_sweep_gpu.sh --wheels      on a machine with pip: the wheels into .whl/ (about
#                                               12 MB, the versions `make setup` installs); carry .whl
#   OUT=$OUT CODE_COMMIT=<c> [MODEL=PAGED_DIR] bash tools/serve_sweep_gpu.sh [-- RECIPE FLAGS]
#                                               on the device (default: micro-mixtral, quantised first)
set -u
if [ "${1:-}" = "--wheels" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 redis==8.2.0 grpcio==1.85.4 grpcio-health-checking==1.85.1 \
    protobuf==7.36.2
  exit
fi
. "$(dirname "$0")/device_call.sh"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
  MODEL=/tmp/paged/micro-mixtral
  stamp "quantising models/micro-mixtral into $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  python3 -m pagedweight.cli.main quantize --model models/micro-mixtral --out "$MODEL" --calib data/sample.txt \
    --device cuda > "$OUT/quantize.log" 2>&1 || { tail -20 "$OUT/quantize.log"; exit 1; }
fi
[ "${1:-}" = "--" ] && shift
stamp "sweep on $MODEL"
python3 -m bench run serve-sweep -- --model "$MODEL" --out "$OUT/serve_sweep.json" "$@" 2>&1 \
  | tee "$OUT/serve_sweep.log" | grep -v '^\[\(planner\|worker\|gateway\)\]'
stamp done
