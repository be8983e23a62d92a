#!/usr/bin/env bash
# The tenth session's third GPU call (one H200): channels-last with cuDNN's persistent
# batch norm, after which the host waits for kiln's stream (the second call's plain
# NHWC batch norm ran ResNet-50 fp32 at 280 img/s). The GPU test of batch norm (NHWC
# in fp32, bf16 and fp16 now persistent), ResNet-50 bf16 and fp32 channels-last,
# ResNet-50 fp32 NCHW, PyTorch fp32 and bf16 + channels_last in the same call,
# ResNet-18 bf16 channels-last and PyTorch's, then the default config in bf16
# channels-last for its accuracy. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and the second
# call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
gpu_test bn cudnn_batch_norm 40
CAP=70 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=50 bench r50-fp32-cl "${R50[@]}" --devices 0 --channels-last
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CAP=90 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CAP=40 bench r50-bf16-cl-2 "${R50[@]}" --devices 0 --precision bf16 --channels-last
train default-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
