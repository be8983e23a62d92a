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
#   8 the default config on one GPU (accuracy, checkpoint share)  9 bf16, determinism and
#   kernel profile beside phase 8  P kernel profile  A the fifth session's runs (see
#   phaseA). Phases run in the order PHASES lists them. Chain the watch calls at once:
#   a machine left idle for 30 s between calls is handed back with everything on it.
#   In the fifth session that happened again (66 s between two calls), so phase A's
#   work was redone by bench/gpu/cudnn.sh, which fits each stage into one call.
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
PHASES=${PHASES:-1,2,3,4,5}
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
  timeout "${BT:-300}" "$K" bench --json "${SET[@]}" "$@" > "$RES/bench-$name.json" 2> "$RES/bench-$name.log"
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
phase1() {
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
}

# Phase 2, data parallelism alone on the GPUs (issue 3).
phase2() {
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
}

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
phase3() {
demo unset
demo cvd-1 CUDA_VISIBLE_DEVICES=1
demo cvd-1-0 CUDA_VISIBLE_DEVICES=1,0
demo cvd-0-1-use-1 CUDA_VISIBLE_DEVICES=0,1 -- --set 'devices.use=[1]'
demo cvd-5 CUDA_VISIBLE_DEVICES=5 -- "${CPU2[@]}"
demo cvd-uuid CUDA_VISIBLE_DEVICES=${UUID1:0:10}
demo cvd-empty CUDA_VISIBLE_DEVICES= -- "${CPU2[@]}"
demo typo CUDA_VISBLE_DEVICES=1
demo config-visible-1 -- --set devices.visible=1
}

# Phase 4, side by side: the default config on both GPUs (issue 3), the same run with
# GPU 1 made to fail at step 1000 (issue 4), and a kill -9 of a one-GPU run followed by
# --resume (issue 4). Concurrent, so their wall times are not throughput figures.
phase4() {
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

}

# Phase 5, issue 5: eight short trials, two at a time on separate GPUs, then one at a time.
sweep() {  # name, max_parallel
  printf 'base = "%s/configs/resnet.toml"\nmax_parallel = %s\nset = ["train.epochs=2", "data.max_train_samples=20480", "devices.cache_dir=%s"]\n[grid]\n"optim.lr" = [0.05, 0.1, 0.2, 0.4]\n"optim.weight_decay" = [5e-4, 1e-3]\n' \
    "$PWD" "$2" "$C" > /tmp/$1.toml
  watch_apps "$RES/apps-$1.csv" & local w=$!
  ( time timeout 500 "$K" sweep --config /tmp/$1.toml --output /tmp/sweeps ) > "$RES/$1.log" 2>&1
  kill $w; cp /tmp/sweeps/$1-*/results.csv "$RES/$1-results.csv"
  log "sweep $1 done"
}
phase5() { sweep sweep-2 2; sweep sweep-1 1; }

# Phase 6, ResNet-50 at 224 px (issue 3): compiled first on GPU 0, then timed.
phase6() {
R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
bench r50-cold "${R50[@]}" --devices 0
share_autotune
bench r50-1 "${R50[@]}" --devices 0
bench r50-2dp "${R50[@]}" --devices 0,1
bench r50-2ddp "${R50[@]}" --devices 0,1 --set train.strategy=ddp
CUDA_VISIBLE_DEVICES=0 torch r50-1 1 "${R50[@]}"
torch r50-2 2 "${R50[@]}"
}

# Phase 7, loading (issue 10): one CIFAR-10 JPEG epoch per loader thread count; the
# epoch line says how long training waited for data.
phase7() {
[ -f .gpu/cifar10-jpg.tar.gz ] || return 0
mkdir -p /tmp/cifar && tar xzf .gpu/cifar10-jpg.tar.gz -C /tmp/cifar
ROOT=$(dirname "$(find /tmp/cifar -type d -name train | head -1)")
for n in 1 2 4 8 16; do
  timeout 300 "$K" train --config configs/resnet-cifar10.toml "${SET[@]}" --devices 0 --output /tmp/runs/load-$n \
    --set data.dataset=image_folder --set data.root="$ROOT" --set train.epochs=1 --set data.num_workers=$n \
    > "$RES/load-$n.log" 2>&1
  log "loading $n workers done ($?)"
done
}

# Phase 8, the default config on one GPU: accuracy reference and the checkpoint share at
# the default interval with checkpoints written in the background (issue 4).
phase8() {
timeout 600 "$K" train "${FM[@]}" --devices "${GPU:-0}" --output /tmp/runs/one > "$RES/fmnist-1gpu.log" 2>&1
cp /tmp/runs/one/*/summary.json "$RES/one-summary.json"; cp /tmp/runs/one/*/metrics.csv "$RES/one-metrics.csv"
log "fmnist 1 gpu done"
}
# The same 100 steps twice on GPU $1 (issue 10, train.deterministic): summary.json keeps
# the final test loss in full f64. (Checkpoint checksums cannot tell: Burn writes random
# parameter ids into model.bin.)
determinism() {
  for r in a b; do
    timeout 300 "$K" train "${FM[@]}" --devices "$1" --output /tmp/runs/det-$r --set train.epochs=1 \
      --set data.max_train_samples=25600 > "$RES/det-$r.log" 2>&1
    cp /tmp/runs/det-$r/*/summary.json "$RES/det-$r-summary.json"
    cp /tmp/runs/det-$r/*/metrics.csv "$RES/det-$r-metrics.csv"
  done
  log "determinism done"
}
# Where the ResNet-18 step goes, kernel by kernel (issue 7): Nsight Systems if the
# machine has it, else cubecl's own profiling logger (a device synchronisation after
# every kernel, so only the per-kernel times are meaningful).
profile() {
  local args=(bench "${SET[@]}" --model resnet18 --image-size 32 --batch 256 --steps 5 --warmup 3 --devices "$1")
  local nsys; nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$nsys" ]; then
    timeout 300 "$nsys" profile -t cuda -o /tmp/r18 --force-overwrite true "$K" "${args[@]}" > "$RES/profile-run.log" 2>&1
    timeout 200 "$nsys" stats -r cuda_gpu_kern_sum -f csv /tmp/r18.nsys-rep > "$RES/profile-kernels.csv" 2> "$RES/profile-stats.log"
  else
    CUBECL_DEBUG_LOG=/tmp/cubecl-profile.log CUBECL_DEBUG_OPTION=profile timeout 300 "$K" "${args[@]}" > "$RES/profile-run.log" 2>&1
    grep -v "^$" /tmp/cubecl-profile.log | tail -n 3000 | xz > "$RES/profile-cubecl.log.xz"
  fi
  log "profile done ($nsys)"
}
# Phase 9, two lanes side by side. GPU 0: the default config in bf16 mixed precision
# (issue 10; cold, its kernels compile first), then the kernel profile. GPU 1: the
# one-GPU fp32 default config (phase 8: accuracy reference, checkpoint share), the
# determinism check, and the ResNet-18 bench in bf16 (cold, then warm).
phase9() {
  ( timeout 1000 "$K" train "${FM[@]}" --devices 0 --output /tmp/runs/bf16 --set train.precision=bf16 \
      > "$RES/fmnist-bf16.log" 2>&1
    echo "exit $?" >> "$RES/fmnist-bf16.log"
    cp /tmp/runs/bf16/*/summary.json "$RES/bf16-summary.json"; cp /tmp/runs/bf16/*/metrics.csv "$RES/bf16-metrics.csv"
    log "fmnist bf16 done"
    profile 0 ) & local a=$!
  ( GPU=1 phase8; determinism 1
    BT=700 bench r18-1-bf16-cold "${R18[@]}" --devices 1 --set train.precision=bf16
    bench r18-1-bf16 "${R18[@]}" --devices 1 --set train.precision=bf16 ) & local b=$!
  wait $a $b
}
# Phase A, everything whose speed is not the point, at once (fifth session): the default
# config to the end in bf16 (GPU 0), fp16 (GPU 1) and fp32 on both GPUs (issues 10 and 3),
# while the cold ResNet-50 and fp16 ResNet-18 benches compile their kernels (the
# compilers run on the CPU; their timed figures are discarded). Then, alone on the
# GPUs, the timed benches those kernels serve, PyTorch beside them.
phaseA() {
  { python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    find / -xdev -name 'libcudnn*.so*' 2>/dev/null | head -n 20; nvidia-smi | head -n 4; } > "$RES/cudnn-probe.txt" 2>&1
  local p g pids=()
  for p in bf16 fp16; do
    g=$([ $p = bf16 ] && echo 0 || echo 1)
    ( timeout 1500 "$K" train "${FM[@]}" --devices $g --output /tmp/runs/$p --set train.precision=$p \
        > "$RES/fmnist-$p.log" 2>&1
      echo "exit $?" >> "$RES/fmnist-$p.log"
      cp /tmp/runs/$p/*/summary.json "$RES/$p-summary.json"; cp /tmp/runs/$p/*/metrics.csv "$RES/$p-metrics.csv"
      log "fmnist $p done" ) & pids+=($!)
  done
  ( timeout 1500 "$K" train "${FM[@]}" --devices 0,1 --output /tmp/runs/two > "$RES/fmnist-2gpu.log" 2>&1
    echo "exit $?" >> "$RES/fmnist-2gpu.log"
    cp /tmp/runs/two/*/summary.json "$RES/two-summary.json"; cp /tmp/runs/two/*/metrics.csv "$RES/two-metrics.csv"
    log "fmnist 2 gpus done" ) & pids+=($!)
  R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
  ( BT=1200 bench r50-cold "${R50[@]}" --devices 0 ) & pids+=($!)
  ( BT=900 bench r18-1-fp16-cold "${R18[@]}" --devices 1 --precision fp16 ) & pids+=($!)
  wait "${pids[@]}"
  share_autotune
  bench r18-1-fp16 "${R18[@]}" --devices 1 --precision fp16
  CUDA_VISIBLE_DEVICES=1 torch r18-1-fp16 1 "${R18[@]}" --precision fp16
  bench r50-1 "${R50[@]}" --devices 0
  bench r50-2ddp "${R50[@]}" --devices 0,1
  CUDA_VISIBLE_DEVICES=0 torch r50-1 1 "${R50[@]}"
  torch r50-2 2 "${R50[@]}"
}
phaseP() { profile 0; }
for p in ${PHASES//,/ }; do log "phase $p"; "phase$p"; done
log "done"
touch "$RES/DONE"
