#!/usr/bin/env bash
# The seventh session's last call (one H200): does cuDNN in bf16 beat Burn's kernels
# now that its stream is ordered on the GPU (the fifth session's 862 img/s against
# 3,419 was with two host waits per call)? ResNet-18 bf16 through cuDNN, PyTorch's
# ResNet-50 bf16 references, then ResNet-50 bf16 through cuDNN while time is left.
set -u
source "$(dirname "$0")/lib.sh"
bench r18-bf16-cudnn "${R18[@]}" --devices 0 --precision bf16 --set train.convolution=cudnn
CUDA_VISIBLE_DEVICES=0 torch r50-bf16 "${R50[@]}" --precision bf16
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
bench r50-bf16-cudnn "${R50[@]}" --devices 0 --precision bf16 --set train.convolution=cudnn
finish
