#!/usr/bin/env bash
# Twelfth session, call 1 (one H200): branch `async-cudnn` (.gpu/kiln-async.xz,
# .gpu/kiln-async-test.xz) beside main (.gpu/kiln.xz, .gpu/kiln-test.xz). Batch-norm
# GPU tests of both builds, one round of benches in turns (main, then async, per model),
# PyTorch bf16 channels-last beside them, then the default config on the async build as
# an end-to-end accuracy check. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
# main's test binary did not fit in the carry beside the branch's; its bench logs show whether the extended batch norm ran
xz -dc .gpu/kiln-async-test.xz > /tmp/kiln-test-async && chmod +x /tmp/kiln-test-async
timeout 40 /tmp/kiln-test-async --ignored cudnn_batch_norm --test-threads 1 > "$RES/test-bn-async.log" 2>&1
log "test bn-async done ($?)"
xz -dc .gpu/kiln-async.xz > /tmp/kiln-async && chmod +x /tmp/kiln-async
KM=$K
for m in r18-bf16-cl r50-bf16-cl r18-fp32 r50-fp32; do
  case $m in
    r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
    r18-fp32) a=("${R18[@]}"); cap=30 ;;
    r50-fp32) a=("${R50[@]}"); cap=40 ;;
  esac
  for b in main async; do
    K=$([ $b = main ] && echo "$KM" || echo /tmp/kiln-async)
    CAP=$cap bench $m-$b "${a[@]}" --devices 0
  done
done
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
K=/tmp/kiln-async
[ "$(left)" -gt 100 ] && train async-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
