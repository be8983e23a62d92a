#!/usr/bin/env bash
# The tenth session's first GPU call (one H200, empty caches): `train.channels_last`.
# ResNet-50 at 224 px in bf16 and fp32 channels-last (cuDNN convolutions and batch norm
# on NHWC tensors) against fp32 NCHW, ResNet-18 at 32 px in bf16 channels-last, PyTorch
# fp32 and bf16 + channels_last in the same call, then the GPU tests of cuDNN's batch
# norm and convolutions (both layouts). Needs .gpu/kiln.xz and .gpu/kiln-test.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
CAP=170 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=120 bench r50-fp32-cl "${R50[@]}" --devices 0 --channels-last
CAP=120 bench r50-fp32 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CAP=60 bench r50-bf16-cl-2 "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=100 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
gpu_test bn cudnn_batch_norm "$(limit)"
gpu_test conv cudnn_matches "$(limit)"
finish
