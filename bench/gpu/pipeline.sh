#!/usr/bin/env bash
# How the H200 figures in BENCHMARKS.md were made: one background pipeline on the
# lent GPU machine (see README "GPU notes"). Expects, in .gpu/ (git-ignored):
#   kiln.xz              stripped release binary, xz-compressed
#   cifar10-jpg.tar.gz   the CIFAR-10 JPEG folder from ../shared/datasets
#   caches.tar.xz        (optional) kernel caches from an earlier run
# Results go to /tmp/res; `bench/gpu/watch.sh` collects them.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p "$RES" /tmp/kcache /tmp/runs
K=/tmp/kiln
xz -dc .gpu/kiln.xz > "$K" && chmod +x "$K"
[ -f .gpu/caches.tar.xz ] && tar xJf .gpu/caches.tar.xz -C /tmp/kcache
mkdir -p /tmp/cifar10 && tar xzf .gpu/cifar10-jpg.tar.gz -C /tmp/cifar10
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
"$K" devices > "$RES/devices.txt" 2>&1
log() { echo "$(date +%T) $*" >> "$RES/pipeline.log"; }

# Phase 1, cold: each workload fills its own kernel cache, in parallel (NVRTC
# compilation is single-threaded per process; the machine has 16 cores).
if [ "${SKIP_COLD:-0}" != 1 ]; then
log "phase 1 start"
"$K" train --config configs/resnet.toml --output /tmp/runs/warm \
  --set train.epochs=1 --set data.max_train_samples=2560 --set devices.cache_dir=/tmp/kcache/fmnist \
  > "$RES/cold-fmnist.log" 2>&1 &
"$K" train --config configs/resnet-cifar10.toml --output /tmp/runs/warm \
  --set data.dataset=image_folder --set data.root=/tmp/cifar10 \
  --set train.epochs=1 --set data.max_train_samples=2560 --set devices.cache_dir=/tmp/kcache/cifar \
  > "$RES/cold-cifar.log" 2>&1 &
( "$K" bench --model resnet18 --image-size 32 --batch 256 --json --set devices.cache_dir=/tmp/kcache/bench \
    > "$RES/cold-bench-r18.json" 2> "$RES/cold-bench-r18.log"
  "$K" bench --model resnet50 --image-size 224 --batch 256 --steps 20 --warmup 3 --breakdown-steps 3 --json \
    --set devices.cache_dir=/tmp/kcache/bench \
    > "$RES/cold-bench-r50.json" 2> "$RES/cold-bench-r50.log" ) &
wait
log "phase 1 done"
fi

# Phase 2, warm and one at a time, so throughput is measured alone on the GPU.
log "fmnist full"
"$K" train --config configs/resnet.toml --output /tmp/runs/full --set devices.cache_dir=/tmp/kcache/fmnist \
  > "$RES/fmnist-full.log" 2>&1
cp /tmp/runs/full/*/summary.json "$RES/fmnist-summary.json"; cp /tmp/runs/full/*/metrics.csv "$RES/fmnist-metrics.csv"
cp /tmp/runs/full/*/curves.png "$RES/fmnist-curves.png"
log "benches"
for m in "resnet18 32 50 10" "resnet50 224 20 5"; do
  set -- $m
  "$K" bench --model $1 --image-size $2 --batch 256 --steps $3 --warmup $4 --json \
    --set devices.cache_dir=/tmp/kcache/bench > "$RES/bench-$1-$2.json" 2> "$RES/bench-$1-$2.log"
  for p in "fp32" "bf16 --channels-last"; do
    python3 bench/pytorch_reference.py --model $1 --image-size $2 --batch 256 --steps $3 --warmup $4 \
      --precision $p >> "$RES/torch-$1-$2.json" 2>> "$RES/torch-$1-$2.log"
  done
done
log "cifar full"
"$K" train --config configs/resnet-cifar10.toml --output /tmp/runs/cifar \
  --set data.dataset=image_folder --set data.root=/tmp/cifar10 --set devices.cache_dir=/tmp/kcache/cifar \
  > "$RES/cifar-full.log" 2>&1
cp /tmp/runs/cifar/*/summary.json "$RES/cifar-summary.json"; cp /tmp/runs/cifar/*/metrics.csv "$RES/cifar-metrics.csv"
log "done"
touch "$RES/DONE"
