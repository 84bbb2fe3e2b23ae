#!/usr/bin/env bash
# Full-depth streaming quantisation of the Qwen1.5-MoE-A2.7B shape on one GPU (issue 14.3),
# within one command's time limit, on a machine whose disk (64 GB) cannot hold the
# checkpoint (28.6 GB), the quantiser's work directory (~24 GB) and the artifact (~23 GB)
# together: the checkpoint and the work directory go to /dev/shm (RAM; the device has
# 128 GiB), the artifact to the disk if it has room. The checkpoint is built in its own
# process so the quantisation's peak host memory is its own.
# LAYERS=N builds only the first N decoder layers (the bench then extrapolates to full depth).
#   OUT=/tmp/out CALIB=2048 DEADLINE_S=280 bash bench/quantize_full_depth.sh
set -uo pipefail
OUT=${OUT:?the folder for the results}
CALIB=${CALIB:-2048}          # calibration tokens per bundled file (4 files)
DEADLINE_S=${DEADLINE_S:-280} # the whole script's time; the quantisation gets what the build leaves
MODEL=${MODEL:-Qwen1.5-MoE-A2.7B}
DEVICE=${DEVICE:-cuda}
NAME=${NAME:-quantize_full_depth_qwen}
LAYERS=${LAYERS:-}            # empty: every layer
layer_args=()
if [ -n "$LAYERS" ]; then layer_args=(--layers "$LAYERS"); fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:services:kernels
start=$SECONDS
SHM=/dev/shm/pagedweight-full-depth
DISK=${TMPDIR:-/tmp}/pagedweight-full-depth
rm -rf "$SHM" "$DISK"
mkdir -p "$SHM" "$DISK"
df -B1 / /dev/shm "$DISK" | tee "$OUT/df_before.txt"
free -g | tee -a "$OUT/df_before.txt"

timeout $((DEADLINE_S - 30)) python3 -m bench.quantize_stream --model "$MODEL" --device "$DEVICE" \
    --checkpoint "$SHM/ckpt" --build-only "${layer_args[@]}" || { echo "build failed or timed out"; exit 3; }
du -sb "$SHM/ckpt" | tee -a "$OUT/df_before.txt"

disk_free=$(df --output=avail -B1 "$DISK" | tail -1)
shm_free=$(df --output=avail -B1 /dev/shm | tail -1)
WORKDIR="$SHM/work"
ART="$DISK"
if [ "$disk_free" -lt 35000000000 ]; then ART="$SHM/art"; fi   # the artifact: ~23 GB
if [ "$shm_free" -lt 60000000000 ]; then WORKDIR="$DISK/work"; fi  # work dir ~24 GB (+ artifact?)
echo "work dir $WORKDIR, artifact in $ART (disk free $disk_free, shm free $shm_free)"

left=$((DEADLINE_S - (SECONDS - start)))
timeout "$left" python3 -m bench.quantize_stream --model "$MODEL" --device "$DEVICE" --calib-tokens "$CALIB" \
    --checkpoint "$SHM/ckpt" --work "$ART" --work-dir "$WORKDIR" --name "$NAME" --copy-to "$OUT"
rc=$?
df -B1 / /dev/shm | tee "$OUT/df_after.txt"
rm -rf "$SHM" "$DISK"
exit $rc
