# Helpers shared by the GPU session scripts (sourced, not run). Everything of a session
# runs inside one call of the `run` tool and stops at a deadline, because a machine left
# idle between calls for more than 30 s is handed back with all it held.
# Expects .gpu/kiln.xz (a stripped, xz-compressed release binary; $KILN_XZ names
# another) and optionally
# .gpu/caches.tar.xz (kiln's kernel and autotune caches from an earlier call); results
# go to $OUT/res and come back as one archive, $OUT/res.tar.gz (the tool returns a
# limited number of files per call), the caches as $OUT/caches.tar.xz.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
START=$(date +%s); DEADLINE=${DEADLINE:-520}
RES=$OUT/res; mkdir -p "$RES" /tmp/kc /tmp/runs
K=/tmp/kiln; C=/tmp/kc
xz -dc "${KILN_XZ:-.gpu/kiln.xz}" > "$K" && chmod +x "$K"
[ -f .gpu/caches.tar.xz ] && tar xJf .gpu/caches.tar.xz -C "$C"
log() { echo "$(date +%T) +$(( $(date +%s) - START ))s $*" >> "$RES/pipeline.log"; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# Seconds a command may run: what is left, or less where CAP (seconds) is set, so a
# hang costs that command, not the call.
limit() { local l; l=$(left); echo $(( ${CAP:-$l} < l ? ${CAP:-$l} : l )); }
SET=(--set devices.cache_dir=$C)
FM=(--config configs/resnet.toml "${SET[@]}")
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10)
R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
# Autotune results are kept per device; GPU 1 reuses GPU 0's (the same model of GPU).
share_autotune() {
  for d in "$C"/autotune/*/device-0-0-cuda; do
    [ -d "$d" ] || continue
    mkdir -p "${d%-0-0-cuda}-0-1-cuda" && cp -n "$d"/* "${d%-0-0-cuda}-0-1-cuda/"
  done
}
share_autotune
# A bench only starts with 60 s left, and never outlives the deadline.
bench() {  # name, then kiln bench args
  local name=$1; shift
  [ "$(left)" -gt 60 ] || { log "bench $name skipped"; return; }
  timeout "$(limit)" "$K" bench --json "${SET[@]}" "$@" > "$RES/bench-$name.json" 2> "$RES/bench-$name.log"
  log "bench $name done ($?)"
}
# One ignored GPU test of .gpu/kiln-test.xz (this build's unit-test binary).
gpu_test() {  # name, test filter, time limit in seconds
  [ "$3" -gt 5 ] || { log "test $1 skipped (${3}s left)"; return; }
  [ -x /tmp/kiln-test ] || { xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test; }
  timeout "$3" /tmp/kiln-test --ignored "$2" --test-threads 1 > "$RES/test-$1.log" 2>&1
  log "test $1 done ($?)"
}
# Benches in turns, so the lease's speed is shared: rounds of NAME-new-I
# (`pin_memory = false`) and NAME-pin-I (`true`).
pin_turns() {  # rounds, name, then kiln bench args
  local n=$1 name=$2 i; shift 2
  for i in $(seq "$n"); do
    CAP=60 bench "$name-new-$i" "$@" --set data.pin_memory=false
    CAP=60 bench "$name-pin-$i" "$@" --set data.pin_memory=true
  done
}
torch() {  # name, then reference args (one GPU, CUDA_VISIBLE_DEVICES set by the caller)
  local name=$1; shift
  [ "$(left)" -gt 40 ] || { log "torch $name skipped"; return; }
  timeout "$(left)" python3 bench/pytorch_reference.py "$@" > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  log "torch $name done ($?)"
}
train() {  # name, gpus, then extra args
  local name=$1 g=$2; shift 2
  timeout "$(left)" "$K" train "${FM[@]}" --devices "$g" --output /tmp/runs/$name "$@" > "$RES/fmnist-$name.log" 2>&1
  echo "exit $?" >> "$RES/fmnist-$name.log"
  cp /tmp/runs/$name/*/summary.json "$RES/$name-summary.json" 2>/dev/null
  cp /tmp/runs/$name/*/metrics.csv "$RES/$name-metrics.csv" 2>/dev/null
  log "fmnist $name done"
}
# GPU utilisation and memory (NVML) and each kiln process's CPU share and age, every
# 10 s, into $RES/watch.txt until `finish`: a hang keeps the GPU busy or idle with the
# CPU quiet, a cold compile keeps the CPU busy and the GPU idle.
watch_gpu() {
  ( while sleep 10; do
      echo "$(date +%T) gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) kiln $(ps -o %cpu=,etime= -C kiln | tr '\n' ' ')"
    done > "$RES/watch.txt" ) &
  WATCH=$!
}
# Every process still running is past the deadline; then the caches come back.
finish() {
  [ -n "${WATCH:-}" ] && kill "$WATCH"
  log "end"
  pkill -x kiln; sleep 1
  tail -n 3 "$RES"/*.log
  cat "$RES/pipeline.log"
  tar czf "$OUT/res.tar.gz" -C "$OUT" res && rm -r "$RES"
  tar cf - -C "$C" . | xz -T0 -3 > "$OUT/caches.tar.xz"; ls -la "$OUT"
}
