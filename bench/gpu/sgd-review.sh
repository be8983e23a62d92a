#!/usr/bin/env bash
# Sixteenth session, call 6 (one H200): after the review of the grouped SGD (outputs
# shaped from their parameter, launches in a fixed order, the thread count named
# once), its GPU test and one ResNet-50 round beside PyTorch. See lib.sh.
set -u
KILN_XZ=.gpu/kiln.xz source "$(dirname "$0")/lib.sh"
gpu_test sgd sgd_kernels 60
BF=(--precision bf16 --channels-last --devices 0)
CAP=40 bench r50 "${R50[@]}" "${BF[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
finish
