#!/usr/bin/env bash
# Fourteenth session, call 3 (one H200): which part of SGD costs the step time that
# plain SGD saved in call 2 (momentum 0.9 and weight decay 5e-4, each alone, neither),
# main (.gpu/kiln.xz) and the re-applied fused SGD (.gpu/kiln-fused.xz) in turns; then
# the default config in bf16 channels-last. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
FUSED=/tmp/kiln-fused; xz -dc .gpu/kiln-fused.xz > "$FUSED" && chmod +x "$FUSED"
watch_gpu
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    esac
    for v in both momentum decay none; do
      case $v in
        both) o=() ;;
        momentum) o=(--set optim.weight_decay=0) ;;
        decay) o=(--set optim.momentum=0) ;;
        none) o=(--set optim.momentum=0 --set optim.weight_decay=0) ;;
      esac
      CAP=$cap bench $m-$v-main-$round "${a[@]}" --devices 0 "${o[@]}"
      K=$FUSED CAP=$cap bench $m-$v-fused-$round "${a[@]}" --devices 0 "${o[@]}"
    done
  done
done
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
[ "$(left)" -gt 100 ] && train main-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
