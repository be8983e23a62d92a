#!/usr/bin/env bash
# How the two-H200 figures in BENCHMARKS.md and the device/failure/sweep demos were made:
# one background pipeline on the lent nvidia-h200-x2 machine (README "GPU notes"), started
# with `setsid bash bench/gpu/two-gpus.sh &` and followed with `bench/gpu/watch.sh`.
# Lessons of earlier runs: every two-GPU step has a timeout (a hang must not eat the
# session), `pkill -f` must not match the calling shell's own command line (nor name a
# function of this script), a bare `wait` also waits for the background samplers, and
# caches are filled once, before anything is timed.
# Expects in .gpu/ (git-ignored): kiln.xz (stripped release binary, xz) and optionally
# caches.tar.xz (kernel caches of an earlier run) and cifar10-jpg.tar.gz (phase 7).
# Results go to /tmp/res. PHASES picks the phases to run (default "1,2,3,4,5"):
#   1 caches  2 ResNet-18 on 1 and 2 GPUs  3 device layer  4 default config on 2 GPUs,
#   GPU failure, kill -9  5 sweeps  6 ResNet-50 on 1 and 2 GPUs  7 loading study
#   8 the default config on one GPU (accuracy, checkpoint share)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p "$RES" /tmp/kc /tmp/runs
K=/tmp/kiln; C=/tmp/kc
xz -dc .gpu/kiln.xz > "$K" && chmod +x "$K"
[ -f .gpu/caches.tar.xz ] && tar xJf .gpu/caches.tar.xz -C "$C"
log() { echo "$(date +%T) $*" >> "$RES/pipeline.log"; }
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
nvidia-smi topo -m > "$RES/topo.txt" 2>&1
nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader > "$RES/gpus.csv"
UUID1=$(sed -n 2p "$RES/gpus.csv" | cut -d, -f2 | tr -d ' ')
SET=(--set devices.cache_dir=$C)
want() { [[ ",${PHASES:-1,2,3,4,5}," == *",$1,"* ]]; }
FM=(--config configs/resnet.toml "${SET[@]}")

# Which physical GPU holds each process, sampled once a second.
watch_apps() {  # $1: file
  while :; do
    echo "# $(date +%T)" >> "$1"
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader >> "$1" 2>&1
    sleep 1
  done
}
# Autotune results are kept per device index; both GPUs are H200s.
share_autotune() {
  for d in "$C"/autotune/*/device-0-0-cuda; do
    mkdir -p "${d%-0-0-cuda}-0-1-cuda" && cp -n "$d"/* "${d%-0-0-cuda}-0-1-cuda/"
  done
}
bench() {  # name, then kiln bench args
  local name=$1; shift
  timeout 300 "$K" bench --json "${SET[@]}" "$@" > "$RES/bench-$name.json" 2> "$RES/bench-$name.log"
  log "bench $name done ($?)"
}
torch() {  # name, gpus, then reference args
  local name=$1 n=$2; shift 2
  if [ "$n" = 1 ]; then
    python3 bench/pytorch_reference.py "$@" > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  else
    python3 -m torch.distributed.run --standalone --nproc_per_node=$n bench/pytorch_reference.py "$@" \
      > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  fi
  log "torch $name done ($?)"
}
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10)

# Phase 1, caches: the Fashion-MNIST kernels on GPU 0 while GPU 1 compiles the ResNet-18
# bench (its first-step time is the cold figure) and runs PyTorch on one GPU.
if want 1; then
log "phase 1: caches"
( CUDA_VISIBLE_DEVICES=0 "$K" warmup "${FM[@]}" > "$RES/warmup-1gpu.log" 2>&1; log "warmup 1 gpu done ($?)" ) &
( export CUDA_VISIBLE_DEVICES=1
  "$K" bench --json "${SET[@]}" "${R18[@]}" > "$RES/cold-r18.json" 2> "$RES/cold-r18.log"
  log "cold r18 done ($?)"
  torch r18-1 1 "${R18[@]}" ) &
wait
share_autotune
timeout 400 "$K" warmup "${FM[@]}" --devices 0,1 > "$RES/warmup-2gpu.log" 2>&1
log "warmup 2 gpus done ($?)"
fi

# Phase 2, data parallelism alone on the GPUs (issue 3).
if want 2; then
bench r18-1 "${R18[@]}" --devices 0
bench r18-2dp "${R18[@]}" --devices 0,1
bench r18-2ddp "${R18[@]}" --devices 0,1 --set train.strategy=ddp
# Transfer granularity (one read-back or upload per tensor by default).
for mib in 4 16 64; do
  bench r18-2dp-b$mib "${R18[@]}" --devices 0,1 --set train.transfer_bucket_mib=$mib
done
torch r18-2 2 "${R18[@]}"
# Issue 10: activation recomputation, memory and speed beside the plain run.
bench r18-1-recompute "${R18[@]}" --devices 0 --set train.gradient_checkpointing=true
fi

# Phase 3, the device layer (issue 9): `kiln devices` and a one-epoch training on
# 12,800 images under each visible-device setting; runs that fall back to the CPU stop
# after two steps.
TRAIN=(train "${FM[@]}" --set train.epochs=1 --set data.max_train_samples=12800)
demo() {  # name, then env assignments, then -- and extra args
  local name=$1; shift
  local envs=() args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift; args=("$@")
  local out="$RES/dev-$name.txt"
  { echo "### env: ${envs[*]:-(CUDA_VISIBLE_DEVICES unset)}  args: ${args[*]:-}"
    echo "### kiln devices"; env -u CUDA_VISIBLE_DEVICES "${envs[@]}" "$K" devices 2>&1; echo "exit $?"
    echo "### kiln train (1 epoch, 12,800 images)"; } > "$out"
  watch_apps "$RES/apps-$name.csv" & local w=$!
  env -u CUDA_VISIBLE_DEVICES "${envs[@]}" timeout 300 "$K" "${TRAIN[@]}" --output /tmp/runs/dev-$name "${args[@]}" >> "$out" 2>&1 &
  wait $!; echo "exit $?" >> "$out"
  kill $w
  log "demo $name done"
}
CPU2=(--set train.max_steps=2 --set data.max_test_samples=512)
if want 3; then
demo unset
demo cvd-1 CUDA_VISIBLE_DEVICES=1
demo cvd-1-0 CUDA_VISIBLE_DEVICES=1,0
demo cvd-0-1-use-1 CUDA_VISIBLE_DEVICES=0,1 -- --set 'devices.use=[1]'
demo cvd-5 CUDA_VISIBLE_DEVICES=5 -- "${CPU2[@]}"
demo cvd-uuid CUDA_VISIBLE_DEVICES=${UUID1:0:10}
demo cvd-empty CUDA_VISIBLE_DEVICES= -- "${CPU2[@]}"
demo typo CUDA_VISBLE_DEVICES=1
demo config-visible-1 -- --set devices.visible=1
fi

# Phase 4, side by side: the default config on both GPUs (issue 3), the same run with
# GPU 1 made to fail at step 1000 (issue 4), and a kill -9 of a one-GPU run followed by
# --resume (issue 4). Concurrent, so their wall times are not throughput figures.
if want 4; then
log "phase 4"
watch_apps "$RES/apps-fault.csv" & W=$!
( timeout 1200 "$K" train "${FM[@]}" --devices 0,1 --output /tmp/runs/two > "$RES/fmnist-2gpu.log" 2>&1
  echo "exit $?" >> "$RES/fmnist-2gpu.log"; log "fmnist 2 gpus done" ) & P1=$!
( timeout 1200 "$K" train "${FM[@]}" --devices 0,1 --output /tmp/runs/fault --set checkpoint.every_steps=100 \
    --set faults.inject=error --set faults.device=1 --set faults.step=1000 > "$RES/fault.log" 2>&1
  echo "exit $?" >> "$RES/fault.log"; log "fault done" ) & P2=$!
( setsid "$K" train "${FM[@]}" --output /tmp/runs/k9 --set train.epochs=2 --set checkpoint.every_steps=50 \
    > "$RES/kill9-first.log" 2>&1 & P=$!
  for _ in $(seq 300); do ls /tmp/runs/k9/*/checkpoints/latest > /dev/null 2>&1 && break; sleep 1; done
  sleep 5; kill -9 -- -$P; log "kill -9 sent"; sleep 1
  timeout 600 "$K" train --resume "$(ls -d /tmp/runs/k9/*/ | head -1)" "${SET[@]}" > "$RES/kill9-resume.log" 2>&1
  echo "exit $?" >> "$RES/kill9-resume.log"; log "kill9 resume done" ) & P3=$!
# Not a bare `wait`: it would also wait for the endless watch_apps loop.
wait $P1 $P2 $P3; kill $W
for r in two fault k9; do
  for f in summary.json metrics.csv failure.json devices.json; do
    cp /tmp/runs/$r/*/$f "$RES/$r-$f" 2>/dev/null
  done
  ls -la /tmp/runs/$r/*/ /tmp/runs/$r/*/checkpoints > "$RES/$r-ls.txt" 2>&1
done

fi

# Phase 5, issue 5: eight short trials, two at a time on separate GPUs, then one at a time.
sweep() {  # name, max_parallel
  printf 'base = "%s/configs/resnet.toml"\nmax_parallel = %s\nset = ["train.epochs=2", "data.max_train_samples=20480", "devices.cache_dir=%s"]\n[grid]\n"optim.lr" = [0.05, 0.1, 0.2, 0.4]\n"optim.weight_decay" = [5e-4, 1e-3]\n' \
    "$PWD" "$2" "$C" > /tmp/$1.toml
  watch_apps "$RES/apps-$1.csv" & local w=$!
  ( time timeout 500 "$K" sweep --config /tmp/$1.toml --output /tmp/sweeps ) > "$RES/$1.log" 2>&1
  kill $w; cp /tmp/sweeps/$1-*/results.csv "$RES/$1-results.csv"
  log "sweep $1 done"
}
want 5 && { sweep sweep-2 2; sweep sweep-1 1; }

# Phase 6, ResNet-50 at 224 px (issue 3): compiled first on GPU 0, then timed.
if want 6; then
R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
bench r50-cold "${R50[@]}" --devices 0
share_autotune
bench r50-1 "${R50[@]}" --devices 0
bench r50-2dp "${R50[@]}" --devices 0,1
bench r50-2ddp "${R50[@]}" --devices 0,1 --set train.strategy=ddp
CUDA_VISIBLE_DEVICES=0 torch r50-1 1 "${R50[@]}"
torch r50-2 2 "${R50[@]}"
fi

# Phase 7, loading (issue 10): one CIFAR-10 JPEG epoch per loader thread count; the
# epoch line says how long training waited for data.
if want 7 && [ -f .gpu/cifar10-jpg.tar.gz ]; then
mkdir -p /tmp/cifar && tar xzf .gpu/cifar10-jpg.tar.gz -C /tmp/cifar
ROOT=$(dirname "$(find /tmp/cifar -type d -name train | head -1)")
for n in 1 2 4 8 16; do
  timeout 300 "$K" train --config configs/resnet-cifar10.toml "${SET[@]}" --devices 0 --output /tmp/runs/load-$n \
    --set data.dataset=image_folder --set data.root="$ROOT" --set train.epochs=1 --set data.num_workers=$n \
    > "$RES/load-$n.log" 2>&1
  log "loading $n workers done ($?)"
done
fi

# Phase 8, the default config on one GPU: accuracy reference and the checkpoint share at
# the default interval with checkpoints written in the background (issue 4).
if want 8; then
timeout 600 "$K" train "${FM[@]}" --devices 0 --output /tmp/runs/one > "$RES/fmnist-1gpu.log" 2>&1
cp /tmp/runs/one/*/summary.json "$RES/one-summary.json"; cp /tmp/runs/one/*/metrics.csv "$RES/one-metrics.csv"
log "fmnist 1 gpu done"
fi
log "done"
touch "$RES/DONE"
