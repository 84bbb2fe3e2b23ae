#!/bin/bash
# One device call: every kernel GPU test (`make test-gpu-kernels`, tests/kernels) and, with
# PATHS=1, the other GPU tests (`make test-gpu-paths`), in parallel pytest processes on the one
# GPU, so the suite fits a call's 600 s (one process at a time ran out after 18-54 kernel tests).
# Every default instance is compiled first, in threads, into the disk cache the shards share
# (atomic writes); then the kernel tests' node ids are split into SHARDS contiguous runs (the
# cases of one test stay together, so an instance the defaults do not precompile compiles in one
# shard only).
# Carry kernel_cache/ from an earlier call of the same source to skip the compiles.
# Usage (device): OUT=$OUT CODE_COMMIT=<c> [SHARDS=4] [PATHS=1] [PRECOMPILE=none] bash tools/gpu_tests_sharded.sh
. "$(dirname "$0")/device_call.sh"
SHARDS=${SHARDS:-4}
PATHS=${PATHS:-1}
LIMIT=${TEST_TIMEOUT_S:-480}
if [ "${PRECOMPILE:-1}" != none ]; then  # (none: a caller compiled them already)
  precompile_defaults
  stamp "precompile rc $?"
fi
ids=/tmp/gpu_test_ids.txt
python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider tests/kernels | grep "::" > "$ids"
n=$(wc -l < "$ids")
stamp "kernel tests: $n in $SHARDS shards"
run_shard() {  # name, then pytest arguments
  local name=$1; shift
  PAGEDWEIGHT_TEST_PRECOMPILE=0 timeout "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    --tb=short --durations=8 "$@" > "$OUT/gpu_tests_$name.log" 2>&1
  echo "$name rc $?"
}
for ((i = 0; i < SHARDS; i++)); do
  mapfile -t part < <(awk -v i="$i" -v s="$SHARDS" -v n="$n" 'NR > int(i * n / s) && NR <= int((i + 1) * n / s)' "$ids")
  run_shard "kernels$i" "${part[@]}" &
done
if [ "$PATHS" = 1 ]; then  # the Makefile's own selection, with the shards' flags
  (PYTEST_ADDOPTS="-p no:cacheprovider -rfE --tb=short --durations=8" timeout "$LIMIT" make test-gpu-paths \
    > "$OUT/gpu_tests_paths.log" 2>&1; echo "paths rc $?") &
fi
wait
stamp "shards done"
for f in "$OUT"/gpu_tests_*.log; do
  echo "== $(basename "$f"): $(grep -E "passed|failed|error" "$f" | tail -n 1)"
  grep -E "^(FAILED|ERROR)" "$f" | head -n 10
done
