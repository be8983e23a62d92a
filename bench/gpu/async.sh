#!/usr/bin/env bash
# For the session after the eleventh (one H200), branch `async-cudnn`: cuDNN calls
# queued on cubecl's device thread without a round trip after each shape's first call
# (`kiln_stream::queue_on_device_thread`). .gpu/kiln.xz is main's build (round trips),
# .gpu/kiln-async.xz and .gpu/kiln-async-test.xz this branch's. The GPU tests of the
# branch first (batch norm, then cuDNN's convolutions: these now queue their repeated
# shapes), then both builds in turns with PyTorch beside them, then the default config
# on the branch's build in fp32 and bf16 channels-last. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
xz -dc .gpu/kiln-async-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
gpu_test bn cudnn_batch_norm 40
gpu_test conv cudnn_matches 200
xz -dc .gpu/kiln-async.xz > /tmp/kiln-async && chmod +x /tmp/kiln-async
KM=$K
for i in 1 2; do
  for b in main async; do
    K=$([ $b = main ] && echo "$KM" || echo /tmp/kiln-async)
    CAP=40 bench r50-fp32-$b-$i "${R50[@]}" --devices 0
    CAP=40 bench r50-bf16-cl-$b-$i "${R50[@]}" --devices 0 --precision bf16 --channels-last
    CAP=30 bench r18-bf16-cl-$b-$i "${R18[@]}" --devices 0 --precision bf16 --channels-last
    CAP=30 bench r18-fp32-$b-$i "${R18[@]}" --devices 0
  done
done
K=/tmp/kiln-async
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
train async-fp32 0
train async-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
