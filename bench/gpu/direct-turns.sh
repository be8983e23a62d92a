#!/usr/bin/env bash
# Fifteenth session, call 2 (one H200): main (the hand-over kernels, one thread per
# channel finishing batch norm's sums) against B (kiln's work on cubecl's own stream,
# learnt through CUPTI) and A (B plus finishing kernels spread over a cube), in turns,
# PyTorch in the same call; then A's GPU tests, which threads A keeps busy, and the
# default config in bf16 channels-last on A. Call 1 (stream-direct.sh) could not run
# main's path: libcupti is in this machine's loader cache, so B found it with or
# without LD_LIBRARY_PATH. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KB=/tmp/kiln-b; xz -dc .gpu/kiln-b.xz > "$KB" && chmod +x "$KB"
KM=/tmp/kiln-main; xz -dc .gpu/kiln-main.xz > "$KM" && chmod +x "$KM"
watch_gpu
gpu_test channels-last-norm channels_last_kernels 60
BF=(--precision bf16 --channels-last --devices 0)
for r in 1 2 3; do
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    K=$KM CAP=90 bench $m-main-$r "${a[@]}" "${BF[@]}"
    K=$KB CAP=60 bench $m-b-$r "${a[@]}" "${BF[@]}"
    CAP=90 bench $m-a-$r "${a[@]}" "${BF[@]}"
  done
  [ $r = 1 ] && CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-1 "${R50[@]}" --precision bf16 --channels-last
  [ $r = 1 ] && CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-1 "${R18[@]}" --precision bf16 --channels-last
done
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl-2 "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl-2 "${R18[@]}" --precision bf16 --channels-last
# Every thread's CPU time over 8 s of A's timed ResNet-50 steps (as threads.sh).
"$K" bench --json "${SET[@]}" "${R50[@]/20/400}" "${BF[@]}" > "$RES/bench-r50-a-threads.json" 2> "$RES/bench-r50-a-threads.log" &
pid=$!; sleep 10
for t in a b; do
  for d in /proc/$pid/task/*; do echo "$(cat $d/comm) $(awk '{print $14+$15}' $d/stat)"; done > "$RES/threads-r50-$t.txt"
  [ $t = a ] && sleep 8
done
wait $pid; log "threads done"
train bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
gpu_test cudnn-conv cudnn_matches $(( $(left) - 25 ))
finish
