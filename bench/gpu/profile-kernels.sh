#!/usr/bin/env bash
# The eleventh session's first GPU call (one H200): the GPU tests of the tenth session's
# last, never-GPU-run commits (batch norm, the pinned upload, then cuDNN against Burn's
# kernels in both layouts with what time is left), ResNet-50 fp32 NCHW with PyTorch
# beside it, and a per-kernel profile (Nsight Compute, one metric: each kernel's
# duration) of a few steps of kiln and PyTorch: why channels-last and cuDNN's bf16 are
# slow in kiln and not in PyTorch. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and
# .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
log "ncu: $NCU"
# One metric, no clock locking or cache flushing: each kernel's duration as it runs
# (kernels are serialised, so overlap is gone).
ncu_run() {  # name, then the command
  local name=$1; shift
  [ "$(left)" -gt 40 ] && [ -n "$NCU" ] || { log "ncu $name skipped"; return; }
  timeout "$(limit)" "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none \
    --csv --log-file "$RES/ncu-$name.csv" "$@" > "$RES/ncu-$name.log" 2>&1
  log "ncu $name done ($?)"
}
gpu_test bn cudnn_batch_norm 40
gpu_test pinned pinned_upload 30
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
P18=(--model resnet18 --image-size 32 --batch 256 --steps 2 --warmup 1)
P50=(--model resnet50 --image-size 224 --batch 64 --steps 1 --warmup 1)
CAP=90 ncu_run k18-bf16-cl "$K" bench --json "${SET[@]}" "${P18[@]}" --devices 0 --precision bf16 --channels-last
CAP=60 ncu_run t18-bf16-cl python3 bench/pytorch_reference.py "${P18[@]}" --precision bf16 --channels-last
CAP=60 ncu_run k18-fp32 "$K" bench --json "${SET[@]}" "${P18[@]}" --devices 0
CAP=90 ncu_run k18-bf16-cudnn "$K" bench --json "${SET[@]}" "${P18[@]}" --devices 0 --precision bf16 --set train.convolution=cudnn
CAP=60 ncu_run t18-bf16 python3 bench/pytorch_reference.py "${P18[@]}" --precision bf16
CAP=90 ncu_run k50-fp32-cl "$K" bench --json "${SET[@]}" "${P50[@]}" --devices 0 --channels-last
CAP=60 ncu_run t50-fp32-cl python3 bench/pytorch_reference.py "${P50[@]}" --channels-last
gpu_test conv cudnn_matches $(( $(left) - 15 ))
finish
