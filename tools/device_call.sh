# Sourced by the device-call scripts (tools/*.sh): strict variables, the import path and
# the commit the results are stamped with (the device copy is no git checkout), $OUT as an
# absolute path, and `stamp` for the elapsed-seconds log lines.
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1 PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown}
OUT_GIVEN=${OUT:+1}
OUT=$(cd "${OUT:-bench/results}" && pwd)
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# Compiled kernels (compile_for_arch's cubins and cupy's cache) live under /tmp/kcache. A call
# that carries kernel_cache/ (git-ignored: copy a previous call's $OUT/kernel_cache.tgz there
# and name the folder in `carry`) starts with them, so a fresh machine compiles only what
# changed since (entries are keyed by the source text); a call given an OUT leaves the cache
# there as kernel_cache.tgz (5.4 MB after the tiles instances of both regimes, bf16; 10 MB with
# the producer-warp instances too, and past the 16 MB a call returns once a run compiles more
# instances: then it does not come back).
export PAGEDWEIGHT_KERNEL_CACHE=/tmp/kcache/arch CUPY_CACHE_DIR=/tmp/kcache/cupy
mkdir -p /tmp/kcache
[ -f kernel_cache/kernel_cache.tgz ] && tar xzf kernel_cache/kernel_cache.tgz -C /tmp/kcache
if [ -n "$OUT_GIVEN" ]; then
  trap 'tar czf "$OUT/kernel_cache.tgz" -C /tmp/kcache . 2> /dev/null' EXIT
fi
# Every default instance (both dtypes and activations) into the disk cache, in threads; its status.
precompile_defaults() {
  python3 - << 'PY'
import torch
from pagedweight_kernels.apl_moe import precompile
for dtype in (torch.bfloat16, torch.float16):
    for activation in ("silu", "gelu_tanh"):
        print("precompiled", dtype, activation, precompile(dtype, activation, max_workers=16), flush=True)
PY
}
