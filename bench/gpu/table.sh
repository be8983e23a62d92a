#!/usr/bin/env bash
# Fourteenth session, call 5 (one H200): the landed build's GPU tests (channels-last
# batch norm, the SGD kernels), then issue 7's table beside PyTorch in the same call:
# ResNet-18 at 32 and 224 px, ResNet-50 at 224 px (batch 128 and 256), fp32 NCHW and
# bf16 channels-last. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
gpu_test channels-last-norm channels_last_kernels 60
gpu_test sgd sgd_kernels 40
R18L=(--model resnet18 --image-size 224 --batch 256 --steps 20 --warmup 5)
R50B=(--model resnet50 --image-size 224 --batch 256 --steps 10 --warmup 3)
BF=(--precision bf16 --channels-last)
for s in r18 r18l r50 r50b; do
  case $s in
    r18) a=("${R18[@]}"); cap=40 ;; r18l) a=("${R18L[@]}"); cap=100 ;;
    r50) a=("${R50[@]}"); cap=45 ;; r50b) a=("${R50B[@]}"); cap=45 ;;
  esac
  # ResNet-18 at 224 px was never cached: its first run compiles.
  CAP=$cap bench $s-bf16-cl "${a[@]}" "${BF[@]}" --devices 0
  CUDA_VISIBLE_DEVICES=0 torch $s-bf16-cl "${a[@]}" "${BF[@]}"
  CAP=$cap bench $s-fp32 "${a[@]}" --devices 0
  CUDA_VISIBLE_DEVICES=0 torch $s-fp32 "${a[@]}"
done
finish
