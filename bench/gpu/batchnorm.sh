#!/usr/bin/env bash
# The eighth session's first GPU call (one H200): BatchNorm's training pass on cuDNN
# (`train.batch_norm`, src/ops/norm.rs and cudnn.rs). The ignored correctness test of
# cuDNN's batch norm against Burn's operations first (test binary .gpu/kiln-test.xz),
# then ResNet-18 and ResNet-50 benches with cuDNN's batch norm (`auto`) and with Burn's
# operations (`burn`), PyTorch beside them, and ResNet-18 in bf16. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout 120 /tmp/kiln-test --ignored cudnn_batch_norm --test-threads 1 > "$RES/test-bn.log" 2>&1
log "test bn done ($?)"
CAP=130 bench r18 "${R18[@]}" --devices 0
CAP=150 bench r50 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CAP=100 bench r18-burn-bn "${R18[@]}" --devices 0 --set train.batch_norm=burn
CAP=90 bench r18-bf16 "${R18[@]}" --devices 0 --precision bf16
finish
