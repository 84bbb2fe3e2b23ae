# Sourced by the device-call scripts (bench/*_gpu.sh): strict variables, the import path and
# the commit the results are stamped with (the device copy is no git checkout), $OUT as an
# absolute path, and `stamp` for the elapsed-seconds log lines.
set -u
export PYTHONPATH=.:services:kernels PYTHONUNBUFFERED=1 PAGEDWEIGHT_COMMIT=${CODE_COMMIT:-unknown}
OUT=$(cd "${OUT:-bench/results}" && pwd)
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
