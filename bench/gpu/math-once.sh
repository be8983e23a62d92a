#!/usr/bin/env bash
# Twelfth session, call 5 (one H200): the convolution descriptor's math type set once
# (in `choose`) instead of before every cuDNN call. Benches with PyTorch beside them,
# then cuDNN's own API log (CUDNN_LOGLEVEL_DBG=3, timestamps per call) of a few
# ResNet-50 bf16 channels-last steps: what happens inside a legacy convolution call.
# See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
CAP=40 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=30 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CAP=30 bench r18-fp32 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
P50=(--model resnet50 --image-size 224 --batch 32 --steps 2 --warmup 1)
CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=/tmp/cudnn.log CAP=60 bench log-r50 "${P50[@]}" --devices 0 --precision bf16 --channels-last
ls -la /tmp/cudnn.log >> "$RES/pipeline.log"; tail -c 30000000 /tmp/cudnn.log | xz -T0 -3 > "$RES/cudnn-log.xz"
finish
