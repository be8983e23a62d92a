#!/usr/bin/env bash
# Thirteenth session, call 4 (one H200): does the optimizer's operation count bound
# the step? The same build (.gpu/kiln-bn.xz, call 1's) with SGD as configured
# (momentum 0.9, weight decay: about nine operations per parameter) and with plain
# SGD (`optim.momentum=0`, `optim.weight_decay=0`: about three), in turns. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
xz -dc .gpu/kiln-bn.xz > "$K" && chmod +x "$K"
PLAIN=(--set optim.momentum=0 --set optim.weight_decay=0)
for round in 1 2; do
  CAP=30 bench r18-sgd-$round "${R18[@]}" --precision bf16 --channels-last --devices 0
  CAP=30 bench r18-plain-$round "${R18[@]}" --precision bf16 --channels-last --devices 0 "${PLAIN[@]}"
  CAP=40 bench r50-sgd-$round "${R50[@]}" --precision bf16 --channels-last --devices 0
  CAP=40 bench r50-plain-$round "${R50[@]}" --precision bf16 --channels-last --devices 0 "${PLAIN[@]}"
done
finish
