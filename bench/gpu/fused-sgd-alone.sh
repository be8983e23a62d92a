#!/usr/bin/env bash
# Fourteenth session, call 4 (one H200): call 3 found the re-applied fused build slower
# than main even with plain SGD, so the fused SGD alone (.gpu/kiln-sgd.xz, without the
# combined convolution gradients) against main (.gpu/kiln.xz) in turns, its kernels'
# GPU test first, PyTorch beside them, and the default config trained with it. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
SGD=/tmp/kiln-sgd; xz -dc .gpu/kiln-sgd.xz > "$SGD" && chmod +x "$SGD"
watch_gpu
gpu_test sgd sgd_kernels 90
for round in 1 2 3; do
  for m in r50-bf16-cl r18-bf16-cl r50-fp32; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
      r50-fp32) [ $round = 3 ] && continue; a=("${R50[@]}"); cap=40 ;;
    esac
    CAP=$cap bench $m-main-$round "${a[@]}" --devices 0
    K=$SGD CAP=$cap bench $m-sgd-$round "${a[@]}" --devices 0
  done
done
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
[ "$(left)" -gt 90 ] && K=$SGD train sgd-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
