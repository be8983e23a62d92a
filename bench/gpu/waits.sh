#!/usr/bin/env bash
# The eleventh session's fourth GPU call (one H200, the last 300 s of device time):
# kiln's own waits per step (`waits` in `kiln bench --json`: round trips to cubecl's
# device thread, host waits for a stream) in channels-last bf16 and NCHW fp32, to
# split the host-bound step; then ResNet-18 fp16 channels-last with what is left (its
# kernels still compiling). Needs .gpu/kiln.xz and .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
CAP=30 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
CAP=30 bench r50-fp32 "${R50[@]}" --devices 0
CAP=30 bench r50-bf16 "${R50[@]}" --devices 0 --precision bf16
CAP=25 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=25 bench r18-fp32 "${R18[@]}" --devices 0
CAP=$(( $(left) - 25 )) bench r18-fp16-cl "${R18[@]}" --devices 0 --precision fp16 --channels-last
finish
