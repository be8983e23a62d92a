#!/usr/bin/env bash
# Twelfth session, call 4 (one H200): kiln's library calls on the device thread timed
# by kind (cuDNN's convolution parts, its batch norm each way, the upload), at two
# batch sizes of ResNet-50. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
R50_32=(--model resnet50 --image-size 224 --batch 32 --steps 40 --warmup 5)
CAP=40 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=40 bench r50-bf16-cl-b32 "${R50_32[@]}" --devices 0 --precision bf16 --channels-last
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CAP=40 bench r50-fp32-b32 "${R50_32[@]}" --devices 0
CAP=30 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=30 bench r18-fp32 "${R18[@]}" --devices 0
finish
