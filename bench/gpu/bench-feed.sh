#!/usr/bin/env bash
# Fourteenth session, call 1 (one H200): the bench's per-step copy of its synthetic
# batch made on a feeding thread, as `train`'s loader threads make batches
# (.gpu/kiln.xz), against the thirteenth session's build that cloned the batch on the
# step's own thread (.gpu/kiln-old.xz), in turns, PyTorch beside them; first the
# channels-last batch-norm kernels' GPU test of this build (the thirteenth session's
# last review mends were never GPU-run). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
OLD=/tmp/kiln-old; xz -dc .gpu/kiln-old.xz > "$OLD" && chmod +x "$OLD"
watch_gpu
gpu_test channels-last-norm channels_last_kernels 120
R50B=(--model resnet50 --image-size 224 --batch 256 --steps 10 --warmup 3)
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl r50-fp32; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
      r50-fp32) a=("${R50[@]}"); cap=40 ;;
    esac
    K=$OLD CAP=$cap bench $m-old-$round "${a[@]}" --devices 0
    CAP=$cap bench $m-new-$round "${a[@]}" --devices 0
  done
done
K=$OLD CAP=45 bench r50-b256-bf16-cl-old "${R50B[@]}" --precision bf16 --channels-last --devices 0
CAP=45 bench r50-b256-bf16-cl-new "${R50B[@]}" --precision bf16 --channels-last --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-fp32 "${R50[@]}"
finish
