#!/usr/bin/env bash
# Thirteenth session, call 6 (one H200): a convolution's two gradients as one custom
# operation of the fusion stream (`ConvBackend::conv2d_grads`; .gpu/kiln.xz) against
# two (.gpu/kiln-sgd.xz, call 5's build), in turns, PyTorch beside them; the default
# config in bf16 channels-last; the convolution GPU test (both gradients through the
# combined operation, against Burn's kernels). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
xz -dc .gpu/kiln-sgd.xz > /tmp/kiln-sgd && chmod +x /tmp/kiln-sgd
KG=$K
for round in 1 2 3; do
  for m in r50-bf16-cl r18-bf16-cl; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    esac
    K=$KG CAP=$cap bench $m-grads-$round "${a[@]}" --devices 0
    K=/tmp/kiln-sgd CAP=$cap bench $m-parts-$round "${a[@]}" --devices 0
  done
done
K=$KG
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
[ "$(left)" -gt 320 ] && train grads-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
gpu_test conv cudnn_matches $(( $(left) - 15 ))
finish
