#!/usr/bin/env bash
# Seventeenth session (one H200; two were not lent): multi-process training on CUDA.
#   A  the default config, one process (`kiln train`), caches cold
#   B  the same through `kiln launch` (one process per GPU: one here), which trains
#      on its rank's shard and sums gradients over the ranks through host memory
#   D  `kiln launch`, its process killed with SIGKILL after a checkpoint: the
#      launcher restarts it from that checkpoint
#   C  two ranks sharing the one H200 (started by hand, as `kiln launch` would on two
#      GPUs: KILN_RANK..., CUDA_VISIBLE_DEVICES=0 for both): the cross-process path on
#      CUDA, with the default config
#   T  PyTorch beside it: ResNet-18 32 px plain and as DDP of one process (torchrun)
# MODE=first runs A B D T. MODE=second (after one process skips the exchange when
# it is alone) runs B again, C, and C for 3 epochs with transfers in 64 MiB buckets.
# Needs .gpu/kiln.xz (and .gpu/caches.tar.xz from a first call). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
run_fm() {  # name, then the command after $K
  local name=$1; shift
  timeout "$(limit)" "$K" "$@" "${FM[@]}" --output /tmp/runs/$name > "$RES/$name.log" 2>&1
  echo "exit $?" >> "$RES/$name.log"
  cp /tmp/runs/$name/*/summary.json "$RES/$name-summary.json" 2> /dev/null
  cp /tmp/runs/$name/*/metrics.csv "$RES/$name-metrics.csv" 2> /dev/null
  log "$name done"
}
two_ranks() {  # name, then extra train args
  local name=$1 r; shift
  for r in 0 1; do
    KILN_RANK=$r KILN_WORLD_SIZE=2 KILN_LOCAL_RANK=$r KILN_LOCAL_WORLD_SIZE=2 \
      KILN_MASTER_PORT=29555 CUDA_VISIBLE_DEVICES=0 \
      timeout "$(limit)" "$K" train "${FM[@]}" "$@" --output /tmp/runs/$name > "$RES/$name-rank$r.log" 2>&1 &
  done
  wait
  cp /tmp/runs/$name/*/summary.json "$RES/$name-summary.json" 2> /dev/null
  cp /tmp/runs/$name/*/metrics.csv "$RES/$name-metrics.csv" 2> /dev/null
  log "$name done"
}
kill_test() {
  timeout "$(limit)" "$K" launch "${FM[@]}" --set train.epochs=4 --output /tmp/runs/kill > "$RES/kill.log" 2>&1 &
  local launcher=$! run="" i
  for i in $(seq 300); do
    run=$(ls -d /tmp/runs/kill/*/ 2> /dev/null | head -1)
    [ -n "$run" ] && [ -f "$run/checkpoints/latest" ] && break
    sleep 1
  done
  sleep 3
  local pid
  pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[0]['pid'])" "$run/ranks.json")
  log "kill -9 rank 0 (pid $pid) after $(cat "$run/checkpoints/latest")"
  kill -9 "$pid"
  wait "$launcher"
  echo "exit $?" >> "$RES/kill.log"
  cp "$run"/summary.json "$RES/kill-summary.json" 2> /dev/null
  log "kill done"
}
if [ "${MODE:-first}" = first ]; then
  run_fm A train --devices 0
  run_fm B launch
  kill_test
  CUDA_VISIBLE_DEVICES=0 torch r18-plain "${R18[@]}"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" torchrun --standalone --nproc_per_node=1 \
    bench/pytorch_reference.py "${R18[@]}" > "$RES/torch-r18-ddp1.json" 2> "$RES/torch-r18-ddp1.log"
  log "torch ddp1 done"
else
  run_fm B2 launch
  two_ranks C
  two_ranks C64 --set train.epochs=3 --set train.transfer_bucket_mib=64
fi
finish
