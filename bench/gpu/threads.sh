#!/usr/bin/env bash
# Thirteenth session, call 2 (one H200): which of kiln's threads is busy through a
# ResNet-50 (and -18) bf16 channels-last bench: every thread's name and CPU time
# (/proc/PID/task/*/stat, utime+stime in clock ticks) twice, 8 s apart, while the
# timed steps run. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
sample() {  # name, then kiln bench args
  local name=$1; shift
  "$K" bench --json "${SET[@]}" "$@" --devices 0 > "$RES/bench-$name.json" 2> "$RES/bench-$name.log" &
  local pid=$! t
  sleep "$SETTLE"
  for t in a b; do
    for d in /proc/$pid/task/*; do
      echo "$(cat $d/comm) $(awk '{print $14+$15}' $d/stat)"
    done > "$RES/threads-$name-$t.txt"
    [ $t = a ] && sleep 8
  done
  wait $pid
  log "sample $name done"
}
SETTLE=12 sample r50 "${R50[@]/20/500}" --precision bf16 --channels-last
SETTLE=10 sample r18 "${R18[@]/50/2500}" --precision bf16 --channels-last
finish
