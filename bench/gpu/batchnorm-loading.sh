#!/usr/bin/env bash
# The eighth session's third GPU call (one H200). (1) cuDNN's batch norm against Burn's
# operations, interleaved (auto, burn, auto, burn) so a slower stretch of the lease
# shows as a difference between repeats, not between settings; PyTorch fp32 between.
# (2) Loading real images, kiln beside PyTorch's DataLoader: 22,000 images of the
# CIFAR-10 JPEG folder (.gpu/cifar-sub.tar.gz: the first 2,000 training and 200 test
# images of each class; the whole folder does not fit the carry next to the binary and
# caches), two epochs each, num_workers 1/2/4/8. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
mkdir -p /tmp/cifar && tar xzf .gpu/cifar-sub.tar.gz -C /tmp/cifar
R18L=(--model resnet18 --image-size 32 --batch 256 --steps 100 --warmup 10)
for i in 1 2; do
  CAP=60 bench r18-auto-$i "${R18L[@]}" --devices 0
  CAP=60 bench r18-burn-$i "${R18L[@]}" --devices 0 --set train.batch_norm=burn
done
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18L[@]}"
for i in 1 2; do
  CAP=60 bench r50-auto-$i "${R50[@]}" --devices 0
  CAP=60 bench r50-burn-$i "${R50[@]}" --devices 0 --set train.batch_norm=burn
done
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
for w in 1 2 4 8; do
  [ "$(left)" -gt 60 ] || break
  timeout 60 "$K" train --config configs/resnet-cifar10.toml "${SET[@]}" --devices 0 \
    --output /tmp/runs/cifar-$w --set data.dataset=image_folder --set data.root=/tmp/cifar \
    --set train.epochs=2 --set data.num_workers=$w > "$RES/cifar-kiln-$w.log" 2>&1
  cp /tmp/runs/cifar-$w/*/metrics.csv "$RES/cifar-kiln-$w.csv" 2>/dev/null
  log "kiln cifar $w done"
  for pin in "" --pin-memory; do
    [ "$(left)" -gt 40 ] || break
    CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/pytorch_loading.py --root /tmp/cifar \
      --num-workers $w $pin > "$RES/cifar-torch-$w$pin.json" 2> "$RES/cifar-torch-$w$pin.log"
    log "torch cifar $w $pin done"
  done
done
finish
