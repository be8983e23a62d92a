#!/usr/bin/env bash
# Twelfth session, call 3 (one H200): which of kiln's library calls cost the device
# thread its time. If cuDNN's host time per call grows with the batch, its calls wait
# for the GPU; if it falls without cuDNN's batch norm, the batch-norm calls are the
# slow ones. Same build as call 2 (where-queued.sh). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
R50_32=(--model resnet50 --image-size 224 --batch 32 --steps 40 --warmup 5)
for i in 1 2; do
  CAP=40 bench r50-bf16-cl-$i "${R50[@]}" --devices 0 --precision bf16 --channels-last
  CAP=30 bench r18-bf16-cl-$i "${R18[@]}" --devices 0 --precision bf16 --channels-last
done
CAP=60 bench r50-bf16-cl-b32 "${R50_32[@]}" --devices 0 --precision bf16 --channels-last
CAP=60 bench r50-fp32-b32 "${R50_32[@]}" --devices 0
CAP=40 bench r50-bf16 "${R50[@]}" --devices 0 --precision bf16
CAP=90 bench r50-bf16-cl-burnbn "${R50[@]}" --devices 0 --precision bf16 --channels-last --set train.batch_norm=burn
CAP=60 bench r50-fp32-burnbn "${R50[@]}" --devices 0 --set train.batch_norm=burn
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
finish
