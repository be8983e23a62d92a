#!/usr/bin/env bash
# The ninth session's sixth GPU call (one H200): the build that lands, with
# `data.pin_memory = true` the default. ResNet-50 and ResNet-18 fp32 benches (and
# ResNet-50 once with pageable uploads), PyTorch fp32 and bf16 + channels_last in the
# same call. Needs .gpu/kiln.xz and the fifth call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
for i in 1 2; do CAP=60 bench r50-$i "${R50[@]}" --devices 0; done
CAP=60 bench r50-pageable "${R50[@]}" --devices 0 --set data.pin_memory=false
for i in 1 2 3; do CAP=60 bench r18-$i "${R18[@]}" --devices 0; done
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
finish
