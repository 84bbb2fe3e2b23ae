#!/bin/bash
# One device call after a change to the fused kernel (kernels/pagedweight_kernels/apl_*.cu): the
# smoke set (every regime x width x dtype against the torch reference), the seed models' layer
# shapes against it too, the decode, tiles and staged GPU tests and the pager's captured graphs,
# then the kernel-layer benchmarks of the three seed shapes, their JSON under $OUT. Steps run most
# telling first, each under its own time limit, so a call cut short still returns what it
# measured (stdout is also kept in $OUT/kernel_change.log).
# Usage (device): OUT=$OUT CODE_COMMIT=<c> bash tools/kernel_change_gpu.sh
. "$(dirname "$0")/device_call.sh"
exec > >(tee -a "$OUT/kernel_change.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
touch /tmp/kernel_change_start
# A benchmark writes bench/results/<name>_<gpu>.json in this copy of the tree: the ones written
# during this call go back under $OUT.
results_back() { find bench/results -name "$1_*.json" -newer /tmp/kernel_change_start -exec cp {} "$OUT/" \; ; }
precompile_defaults > /tmp/precompile.log 2>&1
stamp "precompile rc $?"
export PAGEDWEIGHT_TEST_PRECOMPILE=0  # (done above)
timeout 150 python3 -m pytest -q -m gpu -rfE --tb=line tests/kernels/test_gpu_smoke.py | tail -n 12
stamp "smoke rc ${PIPESTATUS[0]}"
# the same kernel at the seed models' real layer shapes, against the reference
timeout 150 python3 -m pytest -q -m gpu -rfE --tb=line tests/kernels/test_seed_shapes_gpu.py | tail -n 12
stamp "seed shapes rc ${PIPESTATUS[0]}"
for shape in qwen mixtral; do
  timeout 100 python3 -m bench run "kernel-layer-$shape" > "/tmp/bench_$shape.log" 2>&1
  stamp "kernel-layer-$shape rc $?"
  results_back "apl_moe_kernel_$shape"
done
timeout 120 python3 -m pytest -q -m gpu -rfE --tb=line tests/kernels/test_apl_moe_gpu.py tests/kernels/test_apl_tiles_wgmma_gpu.py \
  tests/kernels/test_apl_staged_gpu.py | tail -n 12
stamp "decode, tiles and staged tests rc ${PIPESTATUS[0]}"
# the pager's layers (stable launches: the merged kernels in every regime) through captured graphs
timeout 120 python3 -m pytest -q -m gpu -rfE --tb=line tests/weights/test_arena_graph_gpu.py tests/weights/test_pager_gpu.py \
  | tail -n 8
stamp "pager graph tests rc ${PIPESTATUS[0]}"
timeout 100 python3 -m bench run kernel-layer-gemma4 > /tmp/bench_gemma4.log 2>&1
stamp "kernel-layer-gemma4 rc $?"
results_back apl_moe_kernel_gemma4
