#!/usr/bin/env bash
# The ninth session's first GPU call (one H200): cuDNN's calls made whole on cubecl's
# device thread (one blocking round trip per call instead of five to nine) and batches
# uploaded from page-locked memory (`data.pin_memory`). Needs .gpu/kiln-old.xz (the
# build before both, c88e678), .gpu/kiln.xz and .gpu/kiln-test.xz (this build). The
# GPU tests of the pinned upload and of cuDNN's batch norm first, then ResNet-18 and
# ResNet-50 benches of the two builds in turns (old, new, new with pin_memory), each
# model's first run cold (no cache carried), PyTorch fp32 and bf16 + channels_last
# beside them. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
for b in kiln-old kiln-test; do xz -dc .gpu/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
OLD=/tmp/kiln-old
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$RES/gpu.txt"
timeout 60 /tmp/kiln-test --ignored pinned_upload --test-threads 1 > "$RES/test-pinned.log" 2>&1
log "test pinned done ($?)"
timeout 120 /tmp/kiln-test --ignored cudnn_batch_norm --test-threads 1 > "$RES/test-bn.log" 2>&1
log "test bn done ($?)"
PIN=(--set data.pin_memory=true)
CAP=220 bench r18-cold "${R18[@]}" --devices 0
for i in 1 2 3; do
  K=$OLD CAP=60 bench r18-old-$i "${R18[@]}" --devices 0
  CAP=60 bench r18-new-$i "${R18[@]}" --devices 0
  CAP=60 bench r18-pin-$i "${R18[@]}" --devices 0 "${PIN[@]}"
done
CAP=240 bench r50-cold "${R50[@]}" --devices 0 "${PIN[@]}"
for i in 1 2; do
  K=$OLD CAP=60 bench r50-old-$i "${R50[@]}" --devices 0
  CAP=60 bench r50-new-$i "${R50[@]}" --devices 0
  CAP=60 bench r50-pin-$i "${R50[@]}" --devices 0 "${PIN[@]}"
done
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
finish
