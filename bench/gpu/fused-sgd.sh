#!/usr/bin/env bash
# Thirteenth session, call 5 (one H200): SGD as one operation per step
# (`ops/sgd.rs`, `train/fused_sgd.rs`; .gpu/kiln.xz) against Burn's `Sgd`
# (.gpu/kiln-bn.xz, call 1's build), in turns, PyTorch beside them; the GPU tests of
# the SGD kernels and of batch norm; the default config in bf16 channels-last and in
# fp32. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
gpu_test sgd sgd_kernels 60
xz -dc .gpu/kiln-bn.xz > /tmp/kiln-bn && chmod +x /tmp/kiln-bn
KF=$K
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl r50-fp32 r18-fp32; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
      r50-fp32) a=("${R50[@]}"); cap=40 ;;
      r18-fp32) a=("${R18[@]}"); cap=30 ;;
    esac
    [ $round = 2 ] && [ ${m#*-} = fp32 ] && continue
    K=$KF CAP=$cap bench $m-fused-$round "${a[@]}" --devices 0
    K=/tmp/kiln-bn CAP=$cap bench $m-burn-$round "${a[@]}" --devices 0
  done
done
K=$KF
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
[ "$(left)" -gt 120 ] && train fused-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
[ "$(left)" -gt 120 ] && train fused-fp32 0
gpu_test norms batch_norm $(( $(left) - 20 ))
finish
