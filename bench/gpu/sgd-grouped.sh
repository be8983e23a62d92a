#!/usr/bin/env bash
# Sixteenth session, call 3 (one H200): A (the landed build: kiln's work on cubecl's
# stream) against G (A with SGD stepping up to 32 parameters per launch instead of one
# launch per parameter) in turns, PyTorch in the same call; first the GPU tests of A's
# changed kernels and of its SGD kernel (all from G's test binary, .gpu/kiln-test.xz, whose
# other kernels are A's), last the default config on G. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KG=/tmp/kiln-g; xz -dc .gpu/kiln-g.xz > "$KG" && chmod +x "$KG"
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
watch_gpu
timeout 120 /tmp/kiln-test --ignored sgd_kernels --test-threads 1 > "$RES/test-g-sgd.log" 2>&1
log "test g-sgd done ($?)"
gpu_test channels-last-norm channels_last_kernels 90
gpu_test pinned pinned_upload 30
BF=(--precision bf16 --channels-last --devices 0)
for r in 1 2 3; do
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    CAP=60 bench $m-a-$r "${a[@]}" "${BF[@]}"
    K=$KG CAP=90 bench $m-g-$r "${a[@]}" "${BF[@]}"
  done
  [ $r = 3 ] || CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-$r "${R50[@]}" --precision bf16 --channels-last
  [ $r = 3 ] || CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-$r "${R18[@]}" --precision bf16 --channels-last
done
K=$KG train g-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
finish
