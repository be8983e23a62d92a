#!/usr/bin/env bash
# Sixteenth session, call 1 (one H200, kernel caches cold: the fifteenth session's were
# lost with its checkout): A (kiln's work on cubecl's own stream, learnt through CUPTI;
# batch norm's finishing kernels over a cube) alone, while main's build was still
# compiling here: the cold first steps, the shapes of issue 7's table that the turns of
# call 2 leave out (ResNet-50 at batch 256, fp32), each with PyTorch, and the default
# config in bf16 channels-last. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
watch_gpu
BF=(--precision bf16 --channels-last --devices 0)
CAP=240 bench cold-r50-a "${R50[@]}" "${BF[@]}"
CAP=150 bench cold-r18-a "${R18[@]}" "${BF[@]}"
R50B=(--model resnet50 --image-size 224 --batch 256 --steps 10 --warmup 3)
CAP=90 bench r50b-a "${R50B[@]}" "${BF[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50b-bf16-cl "${R50B[@]}" --precision bf16 --channels-last
train bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
CAP=150 bench r50-fp32-a "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50-fp32 "${R50[@]}"
CAP=100 bench r18-fp32-a "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18-fp32 "${R18[@]}"
finish
