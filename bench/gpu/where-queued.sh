#!/usr/bin/env bash
# Twelfth session, call 2 (one H200): main with the queued cuDNN calls, kiln's work on
# the device thread split into library calls and stream ordering, and unused operands
# no longer made contiguous. Benches with PyTorch beside them, a per-kernel profile
# (Nsight Compute, each kernel's duration) of one ResNet-50 bf16 channels-last step of
# kiln and PyTorch (how many kernels, how much GPU time), then the cuDNN convolution
# GPU test (queued calls against Burn's kernels). See lib.sh and profile-kernels.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
NCU=/usr/local/cuda/bin/ncu
ncu_run() {  # name, then the command
  local name=$1; shift
  [ "$(left)" -gt 40 ] || { log "ncu $name skipped"; return; }
  timeout "$(limit)" "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none \
    --csv --log-file "$RES/ncu-$name.csv" "$@" > "$RES/ncu-$name.log" 2>&1
  log "ncu $name done ($?)"
}
CAP=40 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=30 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CAP=30 bench r18-fp32 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
P50=(--model resnet50 --image-size 224 --batch 128 --steps 1 --warmup 1)
CAP=120 ncu_run k50-bf16-cl "$K" bench --json "${SET[@]}" "${P50[@]}" --devices 0 --precision bf16 --channels-last
CAP=60 ncu_run t50-bf16-cl python3 bench/pytorch_reference.py "${P50[@]}" --precision bf16 --channels-last
gpu_test conv cudnn_matches $(( $(left) - 15 ))
finish
