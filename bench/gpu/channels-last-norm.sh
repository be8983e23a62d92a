#!/usr/bin/env bash
# Thirteenth session, call 1 (one H200): channels-last batch norm on kiln's own cubecl
# kernels (`ops/channels_last_norm.rs`, `train.batch_norm = "auto"`) against cuDNN's
# persistent kernels behind a host wait (`--set train.batch_norm=cudnn`), the same
# binary in turns, PyTorch beside them; first the kernels' GPU test against Burn's
# operations, last the default config in bf16 channels-last and the cuDNN batch-norm
# test. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
gpu_test channels-last-norm channels_last_kernels 150
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    esac
    CAP=$cap bench $m-kiln-$round "${a[@]}" --devices 0
    CAP=$cap bench $m-cudnn-$round "${a[@]}" --devices 0 --set train.batch_norm=cudnn
  done
done
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
[ "$(left)" -gt 150 ] && train kiln-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
gpu_test cudnn-norm cudnn_batch_norm $(( $(left) - 20 ))
finish
