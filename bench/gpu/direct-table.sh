#!/usr/bin/env bash
# Fifteenth session, call 3 (one H200): main against A (kiln's work on cubecl's own
# stream, batch norm's finishing kernels over a cube) in five more turns, since call 2's
# turns moved by up to 25% between rounds; then A beside PyTorch for issue 7's table:
# ResNet-50 224 px at batch 256, fp32 at 128, ResNet-18 32 px fp32. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KM=/tmp/kiln-main; xz -dc .gpu/kiln-main.xz > "$KM" && chmod +x "$KM"
watch_gpu
BF=(--precision bf16 --channels-last --devices 0)
for r in 1 2 3 4 5; do
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    K=$KM CAP=60 bench $m-main-$r "${a[@]}" "${BF[@]}"
    CAP=60 bench $m-a-$r "${a[@]}" "${BF[@]}"
  done
  if [ $r = 2 ] || [ $r = 4 ]; then
    CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-$r "${R50[@]}" --precision bf16 --channels-last
    CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-$r "${R18[@]}" --precision bf16 --channels-last
  fi
done
R50B=(--model resnet50 --image-size 224 --batch 256 --steps 10 --warmup 3)
CAP=60 bench r50b-a "${R50B[@]}" "${BF[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50b-bf16-cl "${R50B[@]}" --precision bf16 --channels-last
CAP=150 bench r50-fp32-a "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-fp32 "${R50[@]}"
CAP=100 bench r18-fp32-a "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18-fp32 "${R18[@]}"
finish
