#!/usr/bin/env bash
# Thirteenth session, call 7 (one H200): where ResNet-50 bf16 channels-last's step
# goes with batch norm on kiln's kernels (main, .gpu/kiln.xz): each kernel's duration
# over a few steps (Nsight Compute, as the twelfth session's call 2), and the bench at
# batch 128 and 256 (host-bound work per step does not grow with the batch). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
NCU=/usr/local/cuda/bin/ncu
P50=(--model resnet50 --image-size 224 --batch 128 --steps 1 --warmup 1)
CAP=40 bench r50-b128 "${R50[@]}" --precision bf16 --channels-last --devices 0
CAP=50 bench r50-b256 "${R50[@]/128/256}" --precision bf16 --channels-last --devices 0
timeout $(( $(left) - 20 )) "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --csv --log-file "$RES/ncu-k50-bf16-cl.csv" "$K" bench --json "${SET[@]}" "${P50[@]}" --devices 0 \
  --precision bf16 --channels-last > "$RES/ncu-k50.log" 2>&1
log "ncu done ($?)"
xz -T0 -6 "$RES/ncu-k50-bf16-cl.csv"
finish
