#!/usr/bin/env bash
# On a GPU machine: the NCCL gradient exchange beside the single-device path (one GPU: a communicator of one, through both launchers); with several GPUs, scaling beside PyTorch DDP.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
GPUS=$(nvidia-smi -L | wc -l)
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10)
R50=(--model resnet50 --image-size 224 --batch 128 --steps 40 --warmup 5 --precision bf16 --channels-last)
NCCL=(--set parallel.exchange=nccl)
for i in 1 2; do
  CAP=90 kbench r18-plain-$i "${R18[@]}" --devices 0
  CAP=90 kbench r18-nccl-$i "${R18[@]}" --devices 0 "${NCCL[@]}"
  CAP=120 kbench r50-plain-$i "${R50[@]}" --devices 0
  CAP=120 kbench r50-nccl-$i "${R50[@]}" --devices 0 "${NCCL[@]}"
done
ktrain plain train --config configs/resnet.toml --devices 0
ktrain nccl train --config configs/resnet.toml --devices 0 "${NCCL[@]}"
ktrain launch launch --config configs/resnet.toml --nproc 1 "${NCCL[@]}"
if [ "$GPUS" -gt 1 ]; then
  all=$(seq -s, 0 $((GPUS - 1)))
  for p in fp32 bf16; do
    cl=(); [ $p = bf16 ] && cl=(--channels-last)
    CAP=120 kbench r18-$p-1gpu "${R18[@]}" --precision $p "${cl[@]}" --devices 0
    CAP=120 kbench r18-$p-${GPUS}gpu "${R18[@]}" --precision $p "${cl[@]}" --devices "$all"
    CUDA_VISIBLE_DEVICES=0 tbench r18-$p-1gpu "${R18[@]}" --precision $p "${cl[@]}"
    [ "$(left)" -gt 60 ] && timeout "$(limit)" torchrun --standalone --nproc_per_node="$GPUS" bench/pytorch_reference.py "${R18[@]}" --precision $p "${cl[@]}" > "$RES/torch-r18-$p-ddp.json" 2> "$RES/torch-r18-$p-ddp.log"
    log "torch r18 $p ddp: $(tail -c 300 "$RES/torch-r18-$p-ddp.json")"
  done
  ktrain two train --config configs/resnet.toml --devices "$all"
  ktrain launch-two launch --config configs/resnet.toml
  # A GPU failing in the middle of the exchange: the supervisor finishes on the others.
  F=(--config configs/resnet.toml --devices "$all" --set train.epochs=3 --set checkpoint.every_steps=100 --set faults.device=1 --set faults.step=300)
  ktrain fail-error train "${F[@]}" --set faults.inject=error
  ktrain fail-hang train "${F[@]}" --set faults.inject=hang --set watchdog.hang_timeout_s=30
  # A rank killed with SIGKILL under kiln launch, after its first checkpoint.
  ( sleep 45; pkill -KILL -n -f "kiln train .*launch-kill" ) &
  ktrain launch-kill launch --config configs/resnet.toml --set train.epochs=3 --set checkpoint.every_steps=100
fi
[ -n "${KEEP:-}" ] || finish
