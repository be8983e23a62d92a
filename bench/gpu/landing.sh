#!/usr/bin/env bash
# The eleventh session's third GPU call (one H200): the build that lands (cuDNN for
# every precision and layout, tensor-op math for bf16/fp16, the extended NHWC batch
# norm, channels-last no longer refused by `kiln train`). The GPU test of batch norm,
# the default config in bf16 channels-last to the end (accuracy), the benches in
# bf16 and fp32 with PyTorch beside them, an experiment build whose channels-last
# batch norm is ordered on the GPU instead of by a host wait (.gpu/kiln-gpu-order.xz:
# does the persistent kernel hang behind the hand-over, and what does the host wait
# cost?), then fp16. Needs .gpu/kiln.xz, .gpu/kiln-test.xz, .gpu/kiln-gpu-order.xz and
# .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
gpu_test bn cudnn_batch_norm 30
timeout 150 "$K" train "${FM[@]}" --devices 0 --output /tmp/runs/bf16-cl --set train.precision=bf16 \
  --set train.channels_last=true > "$RES/fmnist-bf16-cl.log" 2>&1
echo "exit $?" >> "$RES/fmnist-bf16-cl.log"
cp /tmp/runs/bf16-cl/*/summary.json "$RES/bf16-cl-summary.json"; cp /tmp/runs/bf16-cl/*/metrics.csv "$RES/bf16-cl-metrics.csv"
log "fmnist bf16-cl done"
CAP=40 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CAP=40 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CAP=40 bench r50-bf16 "${R50[@]}" --devices 0 --precision bf16
CUDA_VISIBLE_DEVICES=0 torch r50-bf16 "${R50[@]}" --precision bf16
CAP=40 bench r18-bf16 "${R18[@]}" --devices 0 --precision bf16
CUDA_VISIBLE_DEVICES=0 torch r18-bf16 "${R18[@]}" --precision bf16
CAP=40 bench r50-fp32 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CAP=40 bench r18-fp32 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
xz -dc .gpu/kiln-gpu-order.xz > /tmp/kiln-gpu && chmod +x /tmp/kiln-gpu
KL=$K; K=/tmp/kiln-gpu
CAP=30 bench gpu-order-r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=30 bench gpu-order-r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
K=$KL
CAP=90 bench r50-fp16-cl "${R50[@]}" --devices 0 --precision fp16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-fp16-cl "${R50[@]}" --precision fp16 --channels-last
CAP=60 bench r18-fp16-cl "${R18[@]}" --devices 0 --precision fp16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-fp16-cl "${R18[@]}" --precision fp16 --channels-last
finish
