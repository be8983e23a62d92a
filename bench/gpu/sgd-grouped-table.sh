#!/usr/bin/env bash
# Sixteenth session, call 4 (one H200): call 3's turns again (A, the landed build,
# against G, SGD stepping up to 32 parameters per launch), PyTorch in every round,
# then G beside PyTorch in fp32. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KG=/tmp/kiln-g; xz -dc .gpu/kiln-g.xz > "$KG" && chmod +x "$KG"
watch_gpu
BF=(--precision bf16 --channels-last --devices 0)
for r in 1 2 3; do
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    CAP=60 bench $m-a-$r "${a[@]}" "${BF[@]}"
    K=$KG CAP=60 bench $m-g-$r "${a[@]}" "${BF[@]}"
  done
  CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-$r "${R50[@]}" --precision bf16 --channels-last
  CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-$r "${R18[@]}" --precision bf16 --channels-last
done
K=$KG CAP=60 bench r50-fp32-g "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-fp32 "${R50[@]}"
K=$KG CAP=60 bench r18-fp32-g "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18-fp32 "${R18[@]}"
finish
