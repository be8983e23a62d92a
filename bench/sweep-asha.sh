#!/usr/bin/env bash
# On a GPU machine: the same learning-rate sweep of the default config twice, as a
# full grid and with [asha]; which trial each picks, and how long each takes.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
base=$(pwd)/configs/resnet.toml
common="base = \"$base\"
set = [\"train.epochs=6\"]"
grid='[grid]
"optim.lr" = [0.01, 0.02, 0.05, 0.1, 0.2, 0.4]'
printf '%s\n%s\n' "$common" "$grid" > /tmp/grid.toml
printf '%s\n[asha]\nmin_epochs = 1\nreduction = 3\n%s\n' "$common" "$grid" > /tmp/asha.toml
for s in asha grid; do
  [ "$(left)" -gt 120 ] || { log "sweep $s skipped"; continue; }
  t0=$(date +%s)
  timeout "$(limit)" "$K" sweep --config /tmp/$s.toml --output /tmp/sweeps-$s > "$RES/sweep-$s.txt" 2> "$RES/sweep-$s.log"
  code=$?
  log "sweep $s: exit $code in $(( $(date +%s) - t0 )) s"
  cat "$RES/sweep-$s.txt" | tee -a "$RES/log.txt"
  grep -E "stopped by ASHA|trials finished" "$RES/sweep-$s.log" | tee -a "$RES/log.txt"
done
[ -n "${KEEP:-}" ] || finish
