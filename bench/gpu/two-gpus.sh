#!/usr/bin/env bash
# How the two-H200 figures in BENCHMARKS.md and the device/failure demos were made:
# one background pipeline on the lent nvidia-h200-x2 machine (README "GPU notes").
# Lessons of its first run: every two-GPU step has a timeout (a hang must not eat the
# session), and `pkill -f` must not match the calling shell's own command line.
# Expects in .gpu/ (git-ignored): kiln.xz (stripped release binary, xz) and optionally
# caches.tar.xz (kernel caches of an earlier run). Results go to /tmp/res;
# `bench/gpu/watch.sh` collects them.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p "$RES" /tmp/kc /tmp/runs
K=/tmp/kiln; C=/tmp/kc
xz -dc .gpu/kiln.xz > "$K" && chmod +x "$K"
[ -f .gpu/caches.tar.xz ] && tar xJf .gpu/caches.tar.xz -C "$C"
log() { echo "$(date +%T) $*" >> "$RES/pipeline.log"; }
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader > "$RES/gpus.csv"
UUID1=$(sed -n 2p "$RES/gpus.csv" | cut -d, -f2 | tr -d ' ')
SET=(--set devices.cache_dir=$C)

# Which physical GPU holds each process, sampled once a second (for the device demo).
watch_apps() {  # $1: file
  while :; do
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader >> "$1" 2>&1
    sleep 1
  done
}

# Phase A, cold: both benches fill the kernel cache, each on its own GPU; meanwhile the
# device-layer demo (issue 9) runs its one-epoch trainings (they only need to run).
log "phase A"
if [ "${SKIP_COLD:-0}" != 1 ]; then
  CUDA_VISIBLE_DEVICES=0 "$K" bench --model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 3 \
    --breakdown-steps 3 --json "${SET[@]}" > "$RES/cold-r50.json" 2> "$RES/cold-r50.log" &
  CUDA_VISIBLE_DEVICES=1 "$K" bench --model resnet18 --image-size 32 --batch 256 --json "${SET[@]}" \
    > "$RES/cold-r18.json" 2> "$RES/cold-r18.log" &
fi
TRAIN=(train --config configs/resnet.toml --set train.epochs=1 --set data.max_train_samples=12800 "${SET[@]}")
demo() {  # name, then env assignments and extra args separated by --
  local name=$1; shift
  local envs=() args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift; args=("$@")
  local out="$RES/dev-$name.txt"
  { echo "### env: ${envs[*]:-(CUDA_VISIBLE_DEVICES unset)}  args: ${args[*]:-}"
    echo "### kiln devices"; env -u CUDA_VISIBLE_DEVICES "${envs[@]}" "$K" devices 2>&1; echo "exit $?"
    echo "### kiln train (1 epoch, 12,800 images)"; } > "$out"
  watch_apps "$RES/apps-$name.csv" & local w=$!
  env -u CUDA_VISIBLE_DEVICES "${envs[@]}" "$K" "${TRAIN[@]}" --output /tmp/runs/dev-$name "${args[@]}" >> "$out" 2>&1
  echo "exit $?" >> "$out"
  kill $w
  log "demo $name done"
}
demo unset
demo cvd-1 CUDA_VISIBLE_DEVICES=1
demo cvd-1-0 CUDA_VISIBLE_DEVICES=1,0
demo cvd-0-1-use-1 CUDA_VISIBLE_DEVICES=0,1 -- --set 'devices.use=[1]'
demo cvd-5 CUDA_VISIBLE_DEVICES=5
demo cvd-uuid CUDA_VISIBLE_DEVICES=${UUID1:0:10}
demo cvd-empty CUDA_VISIBLE_DEVICES= -- --set train.max_steps=2 --set data.max_test_samples=512
demo typo CUDA_VISBLE_DEVICES=1
demo config-visible-1 -- --set devices.visible=1
wait
log "phase A done"
# Autotune results are kept per device index; both GPUs are H200s.
for d in "$C"/autotune/*/device-0-0-cuda; do
  mkdir -p "${d%-0-0-cuda}-0-1-cuda" && cp -n "$d"/* "${d%-0-0-cuda}-0-1-cuda/"
done

# Phase B, warm and one at a time, so throughput is measured alone on the GPUs.
bench() {  # name, then kiln bench args
  local name=$1; shift
  timeout 300 "$K" bench --json "${SET[@]}" "$@" > "$RES/bench-$name.json" 2> "$RES/bench-$name.log"
  log "bench $name done"
}
torch() {  # name, gpus, then reference args
  local name=$1 n=$2; shift 2
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 python3 bench/pytorch_reference.py "$@" > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  else
    python3 -m torch.distributed.run --standalone --nproc_per_node=$n bench/pytorch_reference.py "$@" \
      > "$RES/torch-$name.json" 2> "$RES/torch-$name.log"
  fi
  log "torch $name done"
}
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10)
bench r18-1 "${R18[@]}" --devices 0
bench r18-2dp "${R18[@]}" --devices 0,1
bench r18-2ddp "${R18[@]}" --devices 0,1 --set train.strategy=ddp
torch r18-1 1 "${R18[@]}"
torch r18-2 2 "${R18[@]}"
torch r18-1-bf16cl 1 "${R18[@]}" --precision bf16 --channels-last
torch r18-2-bf16cl 2 "${R18[@]}" --precision bf16 --channels-last

# The default config on both GPUs (issue 3), then a GPU failure (issue 4).
log "fmnist 2 gpus"
timeout 900 "$K" train --config configs/resnet.toml --devices 0,1 --output /tmp/runs/two "${SET[@]}" > "$RES/fmnist-2gpu.log" 2>&1
cp /tmp/runs/two/*/summary.json "$RES/fmnist-2gpu-summary.json"; cp /tmp/runs/two/*/metrics.csv "$RES/fmnist-2gpu-metrics.csv"
log "fault"
watch_apps "$RES/apps-fault.csv" & W=$!
timeout 900 "$K" train --config configs/resnet.toml --devices 0,1 --output /tmp/runs/fault "${SET[@]}" --set checkpoint.every_steps=100 \
  --set faults.inject=error --set faults.device=1 --set faults.step=1000 > "$RES/fault.log" 2>&1
echo "exit $?" >> "$RES/fault.log"; kill $W
for f in summary.json metrics.csv failure.json devices.json; do cp /tmp/runs/fault/*/$f "$RES/fault-$f" 2>/dev/null; done

R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5)
bench r50-1 "${R50[@]}" --devices 0
bench r50-2dp "${R50[@]}" --devices 0,1
bench r50-2ddp "${R50[@]}" --devices 0,1 --set train.strategy=ddp
torch r50-1 1 "${R50[@]}"
torch r50-2 2 "${R50[@]}"

# kill -9 of the whole supervised run mid-epoch, then --resume.
log "kill9"
setsid "$K" train --config configs/resnet.toml --output /tmp/runs/k9 "${SET[@]}" --set train.epochs=2 \
  --set checkpoint.every_steps=50 > "$RES/kill9-first.log" 2>&1 & P=$!
sleep 35; kill -9 -- -$P; sleep 1
"$K" train --resume "$(ls -d /tmp/runs/k9/*/ | head -1)" --set devices.cache_dir=$C > "$RES/kill9-resume.log" 2>&1
echo "exit $?" >> "$RES/kill9-resume.log"
cp /tmp/runs/k9/*/summary.json "$RES/kill9-summary.json"
# Issue 5: eight short trials, two at a time on separate GPUs, then one at a time.
sweep() {  # name, max_parallel
  printf 'base = "%s/configs/resnet.toml"\nmax_parallel = %s\nset = ["train.epochs=2", "data.max_train_samples=20480", "devices.cache_dir=%s"]\n[grid]\n"optim.lr" = [0.05, 0.1, 0.2, 0.4]\n"optim.weight_decay" = [5e-4, 1e-3]\n' \
    "$PWD" "$2" "$C" > /tmp/$1.toml
  watch_apps "$RES/apps-$1.csv" & local w=$!
  ( time "$K" sweep --config /tmp/$1.toml --output /tmp/sweeps ) > "$RES/$1.log" 2>&1
  kill $w; cp /tmp/sweeps/$1-*/results.csv "$RES/$1-results.csv"
  log "sweep $1 done"
}
[ "${SWEEP:-1}" = 1 ] && { sweep sweep-2 2; sweep sweep-1 1; }
log "done"
touch "$RES/DONE"
