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
# Results and the kernel caches come back in $OUT (see lib.sh).
set -u
source "$(dirname "$0")/lib.sh"

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
  ( train fp32 1 ) & local b=$!
  ( bench r50-cudnn "${R50[@]}" --devices 0
    CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}" ) & local a=$!
  wait $a $b
  share_autotune
  bench r50-cudnn-2 "${R50[@]}" --devices 0,1
}

log "stage ${STAGE:-1}"
"stage${STAGE:-1}"
finish
