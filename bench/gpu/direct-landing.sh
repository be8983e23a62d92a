#!/usr/bin/env bash
# Sixteenth session, call 2 (one H200, the kernel caches of call 1): main against A (kiln's work on cubecl's own stream, learnt
# through CUPTI; batch norm's finishing kernels over a cube) in turns, PyTorch in the
# same call. The fifteenth session's call
# 3 measured the same and its results were lost. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KM=/tmp/kiln-main; xz -dc .gpu/kiln-main.xz > "$KM" && chmod +x "$KM"
watch_gpu
BF=(--precision bf16 --channels-last --devices 0)
# Main's own finishing kernels are not in call 1's cache.
K=$KM CAP=90 bench warm-r50-main "${R50[@]/20/3}" "${BF[@]}"
K=$KM CAP=60 bench warm-r18-main "${R18[@]/50/5}" "${BF[@]}"
for r in 1 2 3 4; do
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    K=$KM CAP=60 bench $m-main-$r "${a[@]}" "${BF[@]}"
    CAP=60 bench $m-a-$r "${a[@]}" "${BF[@]}"
  done
  CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-$r "${R50[@]}" --precision bf16 --channels-last
  CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-$r "${R18[@]}" --precision bf16 --channels-last
done
finish
