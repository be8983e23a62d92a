#!/usr/bin/env bash
# The eleventh session's second GPU call (one H200), after the first call's kernel
# profile: cuDNN's half-precision convolutions asked for tensor-op math, and cuDNN's
# extended NHWC batch norm (PyTorch's channels-last kernels). The GPU test of batch
# norm (now also the extended calls), then channels-last and NCHW benches in bf16 and
# fp32 with PyTorch beside them, fp16 last (its kernels may still compile), a short
# kernel profile of ResNet-18 bf16 channels-last, and cuDNN's convolution test with
# what time is left. Needs .gpu/kiln.xz, .gpu/kiln-test.xz, .gpu/caches.tar.xz.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
NCU=/usr/local/cuda/bin/ncu
gpu_test bn cudnn_batch_norm 40
CAP=50 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CAP=50 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CAP=50 bench r50-fp32-cl "${R50[@]}" --devices 0 --channels-last
CAP=50 bench r50-bf16-cudnn "${R50[@]}" --devices 0 --precision bf16 --set train.convolution=cudnn
CUDA_VISIBLE_DEVICES=0 torch r50-bf16 "${R50[@]}" --precision bf16
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CAP=50 bench r18-bf16-cudnn "${R18[@]}" --devices 0 --precision bf16 --set train.convolution=cudnn
CAP=60 timeout 60 "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none --csv \
  --log-file "$RES/ncu-k18-bf16-cl.csv" "$K" bench --json "${SET[@]}" --model resnet18 --image-size 32 \
  --batch 256 --steps 2 --warmup 1 --devices 0 --precision bf16 --channels-last > "$RES/ncu-k18-bf16-cl.log" 2>&1
log "ncu done"
CAP=70 bench r50-fp16-cl "${R50[@]}" --devices 0 --precision fp16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-fp16-cl "${R50[@]}" --precision fp16 --channels-last
gpu_test conv cudnn_matches $(( $(left) - 15 ))
finish
