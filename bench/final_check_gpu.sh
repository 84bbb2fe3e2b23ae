#!/bin/bash
# One device call (issue 13): the fused-kernel GPU tests the last calls did not reach at
# today's defaults (16-byte decode staging, wgmma tiles): GELU, the bit-for-bit knob test, the
# LUT alignment, commit, compact loop, no-valid-expert and no-host-sync tests; then the tiles
# and prefill-size cases of the main test with wgmma as the default; then the engine and
# runtime GPU paths (make test-gpu-paths).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash bench/final_check_gpu.sh
. "$(dirname "$0")/device_call.sh"
run_tests() {  # name timeout pytest-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short "$@" > "$OUT/$name.log" 2>&1
  stamp "$name rc $?"; grep -E "passed|failed|FAILED|Error" "$OUT/$name.log" | tail -n 6
}
run_tests gpu_rest_tests "${REST_TIMEOUT_S:-230}" tests/kernels/test_apl_moe_gpu.py -k "gelu or activation_changes or \
  integer_pipe_knobs or register_lut or commit_moves or compact_decode or no_valid_expert or no_host_sync"
# (the Makefile's selection of the GPU tests outside tests/kernels, with run_tests' flags)
PYTEST_ADDOPTS="-p no:cacheprovider -rfE --tb=short" timeout "${PATHS_TIMEOUT_S:-150}" make test-gpu-paths \
  > "$OUT/gpu_paths_tests.log" 2>&1
stamp "gpu_paths_tests rc $?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_paths_tests.log" | tail -n 6
run_tests gpu_tiles_default_tests "${TILES_TIMEOUT_S:-90}" tests/kernels/test_apl_moe_gpu.py -k "tiles_regime or \
  (kernel_matches_reference and (T40 or T100 or T200 or T64))"
