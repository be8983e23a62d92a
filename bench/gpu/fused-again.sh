#!/usr/bin/env bash
# Fourteenth session, call 2 (one H200): with the bench's batch copies off the step's
# thread (call 1), the thirteenth session's fused SGD and combined convolution
# gradients (e8c495e, re-applied: .gpu/kiln-fused.xz) against main (.gpu/kiln.xz) in
# turns; plain SGD on main as a measure of what the optimizer's operations cost;
# ResNet-50 at batch 256 beside PyTorch's. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
FUSED=/tmp/kiln-fused; xz -dc .gpu/kiln-fused.xz > "$FUSED" && chmod +x "$FUSED"
watch_gpu
R50B=(--model resnet50 --image-size 224 --batch 256 --steps 10 --warmup 3)
PLAIN=(--set optim.momentum=0 --set optim.weight_decay=0)
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl r50-fp32; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
      r50-fp32) a=("${R50[@]}"); cap=40 ;;
    esac
    CAP=$cap bench $m-main-$round "${a[@]}" --devices 0
    K=$FUSED CAP=$cap bench $m-fused-$round "${a[@]}" --devices 0
    [ $m = r50-fp32 ] || CAP=$cap bench $m-plain-$round "${a[@]}" --devices 0 "${PLAIN[@]}"
  done
done
CAP=45 bench r50-b256-bf16-cl-main "${R50B[@]}" --precision bf16 --channels-last --devices 0
K=$FUSED CAP=45 bench r50-b256-bf16-cl-fused "${R50B[@]}" --precision bf16 --channels-last --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-b256-bf16-cl "${R50B[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
finish
