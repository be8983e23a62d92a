#!/usr/bin/env bash
# The eighth session's fourth GPU call (one H200): does training repeat with cuDNN's
# batch norm? The default config for 100 steps twice with `auto` and twice with Burn's
# batch-norm operations (the fourth session's check, then on Burn's kernels: the same
# losses to six digits). Then ResNet-18 benches alternating auto / burn three times
# more (the third call's pairs scattered 6,462-9,140 img/s), and bf16 with Burn's
# batch norm beside the first call's bf16 with cuDNN's. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
for bn in auto burn; do
  for i in 1 2; do
    train det-$bn-$i 0 --set train.epochs=1 --set data.max_train_samples=25600 --set train.batch_norm=$bn
  done
done
R18L=(--model resnet18 --image-size 32 --batch 256 --steps 200 --warmup 10)
for i in 1 2 3; do
  CAP=60 bench r18-auto-$i "${R18L[@]}" --devices 0
  CAP=60 bench r18-burn-$i "${R18L[@]}" --devices 0 --set train.batch_norm=burn
done
CAP=90 bench r18-bf16-burn "${R18[@]}" --devices 0 --precision bf16 --set train.batch_norm=burn
CAP=90 bench r18-bf16-auto "${R18[@]}" --devices 0 --precision bf16
finish
