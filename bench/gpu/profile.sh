#!/usr/bin/env bash
# The seventh session's GPU call (one H200, `nvidia-h200`): the flat image upload of
# `train::step::to_device`, ResNet-50 and ResNet-18 benches with PyTorch beside them, an Nsight Systems
# capture of ResNet-50's warm steps read by bench/nsys_window.py (GPU busy fraction,
# kernels, host API calls; nsys was absent on the first call), then ResNet-18 in bf16
# (issue 10). The second call ran it again with jemalloc as the global allocator. See
# lib.sh.
set -u
source "$(dirname "$0")/lib.sh"

bench r50 "${R50[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
if command -v nsys > /dev/null && [ "$(left)" -gt 150 ]; then
  timeout "$(( $(left) - 60 ))" nsys profile -t cuda --force-overwrite true -o /tmp/r50 \
    "$K" bench --json "${SET[@]}" "${R50[@]}" --steps 10 --warmup 3 --breakdown-steps 0 \
    --devices 0 > "$RES/nsys-r50.json" 2> "$RES/nsys-r50.log"
  nsys export --type sqlite --force-overwrite true -o /tmp/r50.sqlite /tmp/r50.nsys-rep >> "$RES/nsys-r50.log" 2>&1
  step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step_ms'])" "$RES/nsys-r50.json")
  python3 bench/nsys_window.py /tmp/r50.sqlite "$step" 10 > "$RES/nsys-r50.txt" 2>&1
  log "nsys r50 done"
else
  log "nsys: $(command -v nsys || echo absent), skipped"
fi
bench r18 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
bench r18-bf16 "${R18[@]}" --devices 0 --precision bf16
CUDA_VISIBLE_DEVICES=0 torch r18-bf16 "${R18[@]}" --precision bf16
finish
