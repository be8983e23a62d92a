#!/usr/bin/env bash
# The seventh session's third GPU call (one H200): cuDNN's stream ordered against
# cubecl's on the GPU (src/ops/stream_order.rs) instead of two host waits per
# convolution. ResNet-50 and ResNet-18 benches with PyTorch beside them, ResNet-18 in
# bf16 (Burn's kernels, no cuDNN: the same code as the second call of profile.sh, so
# it tells this machine's speed from the change's), then the ignored cuDNN
# correctness test from .gpu/kiln-test.xz (`cargo test --release --no-run`,
# stripped), whose results would be wrong if the ordering let a kernel read a buffer
# early. Every command has its own limit (CAP), so a hang costs that command, not the
# call. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
CAP=170 bench r50 "${R50[@]}" --devices 0
CAP=110 bench r18 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
CAP=90 bench r18-bf16 "${R18[@]}" --devices 0 --precision bf16
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout $(( $(left) - 20 )) /tmp/kiln-test --ignored cudnn_matches --test-threads 1 > "$RES/test-cudnn.log" 2>&1
log "test cudnn done ($?)"
finish
