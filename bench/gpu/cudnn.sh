#!/usr/bin/env bash
# The fifth session's GPU work in single calls of the `run` tool (nvidia-h200-x2):
# everything runs inside one call and stops at a deadline, because a machine left idle
# between calls for more than 30 s is handed back with all it held (it happened twice).
#   STAGE=1: the default config to the end in bf16 (GPU 0) and fp16 (GPU 1) with cuDNN
#            convolutions (issue 10's accuracy), then ResNet-18 benches alone on each
#            GPU: cuDNN and Burn's kernels, fp32/bf16/fp16, PyTorch beside them (issue 7).
#   STAGE=2: the default config in fp32 with cuDNN on GPU 1 (accuracy against Burn's
#            kernels) while GPU 0 runs ResNet-50 with cuDNN (issue 3). Not run yet: the
#            fifth session's device time ended after stage 1 and a follow-up call on the
#            still-warm machine (`kiln train --resume` of the bf16 run, the fp16/bf16
#            benches and PyTorch's references; commands in BENCHMARKS.md).
# Not yet run on a GPU: the cuDNN-against-Burn correctness test, an ignored unit test
# (`cargo test --release --no-run`, carry the stripped test binary, run it with
# `--ignored cudnn_matches` on the GPU machine).
# Results and the kernel caches come back in $OUT. Expects .gpu/kiln.xz and optionally
# .gpu/caches.tar.xz (as two-gpus.sh).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
START=$(date +%s); DEADLINE=${DEADLINE:-520}
RES=$OUT/res; mkdir -p "$RES" /tmp/kc /tmp/runs
K=/tmp/kiln; C=/tmp/kc
xz -dc .gpu/kiln.xz > "$K" && chmod +x "$K"
[ -f .gpu/caches.tar.xz ] && tar xJf .gpu/caches.tar.xz -C "$C"
log() { echo "$(date +%T) +$(( $(date +%s) - START ))s $*" >> "$RES/pipeline.log"; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
SET=(--set devices.cache_dir=$C)
FM=(--config configs/resnet.toml "${SET[@]}")
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10)
share_autotune() {
  for d in "$C"/autotune/*/device-0-0-cuda; do
    mkdir -p "${d%-0-0-cuda}-0-1-cuda" && cp -n "$d"/* "${d%-0-0-cuda}-0-1-cuda/"
  done
}
share_autotune
# A bench only starts with 60 s left, and never outlives the deadline.
bench() {  # name, then kiln bench args
  local name=$1; shift
  [ "$(left)" -gt 60 ] || { log "bench $name skipped"; return; }
  timeout "$(left)" "$K" bench --json "${SET[@]}" "$@" > "$RES/bench-$name.json" 2> "$RES/bench-$name.log"
  log "bench $name done ($?)"
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

stage1() {
  ( bench r18-cudnn "${R18[@]}" --devices 0
    CUDA_VISIBLE_DEVICES=0 torch r18 "${R18[@]}"
    train bf16 0 --set train.precision=bf16
    bench r18-cudnn-bf16 "${R18[@]}" --devices 0 --precision bf16
    CUDA_VISIBLE_DEVICES=0 torch r18-bf16 "${R18[@]}" --precision bf16
    CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
    bench r18-burn "${R18[@]}" --devices 0 --set train.convolution=burn ) & local a=$!
  ( train fp16 1 --set train.precision=fp16
    bench r18-cudnn-fp16 "${R18[@]}" --devices 1 --precision fp16
    CUDA_VISIBLE_DEVICES=1 torch r18-fp16 "${R18[@]}" --precision fp16 ) & local b=$!
  wait $a $b
}

stage2() {
  R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
  ( train fp32 1 ) & local b=$!
  ( bench r50-cudnn "${R50[@]}" --devices 0
    CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}" ) & local a=$!
  wait $a $b
  share_autotune
  bench r50-cudnn-2 "${R50[@]}" --devices 0,1
}

log "stage ${STAGE:-1}"
"stage${STAGE:-1}"
log "end"
# Every process still running is past the deadline; then the caches come back.
pkill -x kiln; sleep 1
tail -n 3 "$RES"/*.log
cat "$RES/pipeline.log"
tar cf - -C "$C" . | xz -T0 -3 > "$OUT/caches.tar.xz"; ls -la "$OUT"
