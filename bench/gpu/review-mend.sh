#!/usr/bin/env bash
# Fourteenth session, call 6 (one H200, the session's last 4 device minutes): the review
# mend of the SGD kernels (Burn's empty-tensor helper, the shared vector-width choice,
# no stand-in buffer allocated with momentum): both kernel GPU tests, then ResNet-18 and
# ResNet-50 bf16 channels-last beside PyTorch. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
gpu_test sgd sgd_kernels 30
gpu_test channels-last-norm channels_last_kernels 40
BF=(--precision bf16 --channels-last)
CAP=25 bench r18-bf16-cl "${R18[@]}" "${BF[@]}" --devices 0
CAP=25 bench r50-bf16-cl "${R50[@]}" "${BF[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" "${BF[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" "${BF[@]}"
finish
