#!/usr/bin/env bash
# The seventh session's third GPU call (one H200): cuDNN's stream ordered against
# cubecl's on the GPU (src/ops/stream_order.rs) instead of two host waits per
# convolution. ResNet-50 and ResNet-18 benches with PyTorch beside them, ResNet-18 in
# bf16 (Burn's kernels, no cuDNN: the same code as the second call of profile.sh, so
# it tells this machine's speed from the change's), then the ignored cuDNN
# correctness test from
# .gpu/kiln-test.xz (`cargo test --release --no-run`, stripped), whose results would
# be wrong if the ordering let a kernel read a buffer early. Every command has its
# own limit, so a hang costs that command, not the call. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
capped() {  # seconds, then a command: at most that long, never past the deadline
  local cap=$1; shift
  local t=$(( $(left) < cap ? $(left) : cap ))
  timeout "$t" "$@"
}
capped 170 "$K" bench --json "${SET[@]}" "${R50[@]}" --devices 0 > "$RES/bench-r50.json" 2> "$RES/bench-r50.log"
log "bench r50 done ($?)"
capped 110 "$K" bench --json "${SET[@]}" "${R18[@]}" --devices 0 > "$RES/bench-r18.json" 2> "$RES/bench-r18.log"
log "bench r18 done ($?)"
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
capped 90 "$K" bench --json "${SET[@]}" "${R18[@]}" --devices 0 --precision bf16 > "$RES/bench-r18-bf16.json" 2> "$RES/bench-r18-bf16.log"
log "bench r18-bf16 done ($?)"
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
capped $(( $(left) - 20 )) /tmp/kiln-test --ignored cudnn_matches --test-threads 1 > "$RES/test-cudnn.log" 2>&1
log "test cudnn done ($?)"
finish
