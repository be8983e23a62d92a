#!/usr/bin/env bash
# The seventh session's first two GPU calls (one H200, `nvidia-h200`): ResNet-50 and
# ResNet-18 benches with PyTorch beside them, then ResNet-18 in bf16 (issue 10). The
# first call ran the flat image upload of `train::step::to_device`, the second the
# same with jemalloc as the global allocator. (Nsight Systems, meant to be captured
# here, is not installed on the GPU machines; Nsight Compute is.) See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"

bench r50 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
bench r18 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
bench r18-bf16 "${R18[@]}" --devices 0 --precision bf16
CUDA_VISIBLE_DEVICES=0 torch r18-bf16 "${R18[@]}" --precision bf16
finish
