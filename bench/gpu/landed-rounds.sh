#!/usr/bin/env bash
# Sixteenth session, call 5 (one H200): the build that lands (G of calls 3-4) beside
# PyTorch in more rounds, alternating one kiln run and one PyTorch run, since ResNet-18's
# rounds spread over 50% within a call. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-g.xz source "$(dirname "$0")/lib.sh"
watch_gpu
BF=(--precision bf16 --channels-last --devices 0)
for r in 1 2 3 4 5 6; do
  CAP=40 bench r18-g-$r "${R18[@]}" "${BF[@]}"
  CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-$r "${R18[@]}" --precision bf16 --channels-last
done
for r in 1 2 3; do
  CAP=40 bench r50-g-$r "${R50[@]}" "${BF[@]}"
  CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-$r "${R50[@]}" --precision bf16 --channels-last
done
finish
