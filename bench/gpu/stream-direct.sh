#!/usr/bin/env bash
# Fifteenth session, call 1 (one H200): kiln's work on cubecl's own stream (learnt
# through CUPTI) against the hand-over kernels, and the channels-last batch norm's
# finishing kernels spread over a cube against one thread per channel. Binaries:
# .gpu/kiln-a.xz (both changes), .gpu/kiln-b.xz (the old finishing kernels); each is
# run with libcupti on the library path (cubecl's stream) and B also without it (the
# hand-over, as main ran). The GPU tests of the changed paths first, then the variants
# in turns, PyTorch in the same call. See lib.sh.
set -u
KILN_XZ=.gpu/kiln-a.xz source "$(dirname "$0")/lib.sh"
KB=/tmp/kiln-b; xz -dc .gpu/kiln-b.xz > "$KB" && chmod +x "$KB"
CUPTI_LIB=$(find /usr/local/cuda*/extras /usr/local/lib /usr/lib /opt -name 'libcupti.so*' 2>/dev/null | head -1)
CUPTI_DIR=$(dirname "${CUPTI_LIB:-/nonexistent/x}")
{ echo "cupti: $CUPTI_LIB"; ldconfig -p | grep -i cupti; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; nvidia-smi; } > "$RES/machine.txt" 2>&1
WITH=${CUPTI_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
watch_gpu
export LD_LIBRARY_PATH=$WITH
gpu_test channels-last-norm channels_last_kernels 100
gpu_test cudnn-conv cudnn_matches 60
gpu_test cudnn-norm cudnn_batch_norm 60
gpu_test pinned pinned_upload 30
BF=(--precision bf16 --channels-last --devices 0)
# Cold: fills the kernel cache for both models (A's kernels; B compiles its two
# finishing kernels on its first run).
CAP=200 bench warm-r50 "${R50[@]/20/3}" "${BF[@]}"
CAP=120 bench warm-r18 "${R18[@]/50/5}" "${BF[@]}"
turn() {  # round
  local r=$1
  for m in r50 r18; do
    [ $m = r50 ] && a=("${R50[@]}") || a=("${R18[@]}")
    K=/tmp/kiln CAP=60 bench $m-a-direct-$r "${a[@]}" "${BF[@]}"
    K=$KB CAP=60 bench $m-b-direct-$r "${a[@]}" "${BF[@]}"
    LD_LIBRARY_PATH=${LD_LIBRARY_PATH#"$CUPTI_DIR"} K=$KB CAP=60 bench $m-b-handover-$r "${a[@]}" "${BF[@]}"
  done
}
turn 1
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
turn 2
finish
