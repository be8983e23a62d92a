#!/usr/bin/env bash
# Twelfth session, call 6 (one H200): convolutions through cuDNN's graph API (plans
# finalized once per shape, `ops/cudnn/graph.rs`; .gpu/kiln.xz) against the legacy
# calls (.gpu/kiln-legacy.xz, the build of call 5), in turns, PyTorch beside them, the
# default config in bf16 channels-last, then the cuDNN convolution GPU test (graph
# plans against Burn's kernels, with its notes shown). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
xz -dc .gpu/kiln-legacy.xz > /tmp/kiln-legacy && chmod +x /tmp/kiln-legacy
KG=$K
for m in r50-bf16-cl r18-bf16-cl r50-fp32 r18-fp32; do
  case $m in
    r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
    r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    r50-fp32) a=("${R50[@]}"); cap=40 ;;
    r18-fp32) a=("${R18[@]}"); cap=30 ;;
  esac
  for b in graph legacy; do
    K=$([ $b = graph ] && echo "$KG" || echo /tmp/kiln-legacy)
    CAP=$cap bench $m-$b "${a[@]}" --devices 0
  done
done
K=$KG
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
[ "$(left)" -gt 300 ] && train graph-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout $(( $(left) - 15 )) /tmp/kiln-test --ignored cudnn_matches --test-threads 1 --nocapture > "$RES/test-conv.log" 2>&1
log "test conv done ($?)"
finish
