# Helpers for the scripts that run on a GPU machine (sourced, not run). They expect
# .gpu/kiln.xz and .gpu/kiln-test.xz (from bench/build.sh) and optionally
# .gpu/caches.tar.xz (kernel and autotune caches of an earlier run); results go to
# $OUT/res.tar.gz, the caches to $OUT/caches.tar.xz. Every command stops at a common
# deadline, END (epoch seconds; default: 540 s after the first script started).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
: "${OUT:=/tmp/kiln-out}"
export END=${END:-$(( $(date +%s) + 540 ))}
RES=$OUT/res; mkdir -p "$RES" /tmp/kc /tmp/runs
K=/tmp/kiln; T=/tmp/kiln-test; C=/tmp/kc
[ -x "$K" ] || { xz -dc .gpu/kiln.xz > "$K" && chmod +x "$K"; }
[ -x "$T" ] || { [ -f .gpu/kiln-test.xz ] && xz -dc .gpu/kiln-test.xz > "$T" && chmod +x "$T"; }
[ -f .gpu/caches.tar.xz ] && [ ! -f "$C/.restored" ] && tar xJf .gpu/caches.tar.xz -C "$C" && touch "$C/.restored"
export KILN_CACHE_DIR=$C
log() { echo "$(date +%T) $*" | tee -a "$RES/log.txt"; }
left() { echo $(( END - $(date +%s) )); }
# Seconds a command may run: what is left, or CAP where that is less.
limit() { local l; l=$(left); echo $(( ${CAP:-$l} < l ? ${CAP:-$l} : l )); }
# kiln bench as JSON: name, then its arguments.
kbench() {
  local name=$1; shift
  [ "$(left)" -gt 40 ] || { log "bench $name skipped"; return; }
  timeout "$(limit)" "$K" bench --json "$@" > "$RES/kiln-$name.json" 2> "$RES/kiln-$name.log"
  log "kiln bench $name: exit $? $(tail -c 300 "$RES/kiln-$name.json")"
}
# bench/pytorch_reference.py as JSON: name, then its arguments.
tbench() {
  local name=$1; shift
  [ "$(left)" -gt 40 ] || { log "torch $name skipped"; return; }
  timeout "$(limit)" python3 bench/pytorch_reference.py "$@" > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  log "torch $name: exit $? $(tail -c 300 "$RES/torch-$name.json")"
}
# kiln train of the default config: name, then the command after `kiln` and extra args.
ktrain() {
  local name=$1; shift
  [ "$(left)" -gt 60 ] || { log "train $name skipped"; return; }
  timeout "$(limit)" "$K" "$@" --output /tmp/runs/$name > "$RES/$name.log" 2>&1
  log "train $name: exit $?"
  cp /tmp/runs/$name/*/summary.json "$RES/$name-summary.json" 2> /dev/null
  cp /tmp/runs/$name/*/metrics.csv "$RES/$name-metrics.csv" 2> /dev/null
  grep -h "finished\|first step\|error" "$RES/$name.log" | tail -n 4 | sed "s/^/  $name: /" | tee -a "$RES/log.txt"
}
# Results and caches back through $OUT.
finish() {
  pkill -x kiln; sleep 1
  tar czf "$OUT/res.tar.gz" -C "$OUT" res && rm -r "$RES"
  rm -f "$C/.restored"
  tar cf - -C "$C" . | xz -T0 -3 > "$OUT/caches.tar.xz"
  ls -la "$OUT"
}
