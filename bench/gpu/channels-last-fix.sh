#!/usr/bin/env bash
# The tenth session's second GPU call (one H200): channels-last after batch norm left
# cuDNN's persistent mode, which the first call's channels-last benches never finished
# their first step with. GPU utilisation and kiln's CPU use are sampled every 10 s
# (a hang spins the GPU; a cold compile keeps the CPU busy and the GPU idle). If the
# first bench still does not finish, the same bench with Burn's batch norm tells
# which cuDNN call holds it. Then ResNet-50 fp32 channels-last, ResNet-18 bf16
# channels-last, the default config in bf16 channels-last to the end (accuracy), and
# the GPU test of cuDNN's convolutions in both layouts. Needs .gpu/kiln.xz,
# .gpu/kiln-test.xz and the first call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
CAP=150 bench r50-bf16-cl "${R50[@]}" --devices 0 --precision bf16 --channels-last
if ! grep -q img_per_s "$RES/bench-r50-bf16-cl.json"; then
  CAP=120 bench r50-bf16-cl-burnbn "${R50[@]}" --devices 0 --precision bf16 --channels-last --set train.batch_norm=burn
fi
CAP=100 bench r50-fp32-cl "${R50[@]}" --devices 0 --channels-last
CAP=100 bench r18-bf16-cl "${R18[@]}" --devices 0 --precision bf16 --channels-last
CAP=60 bench r50-bf16-cl-2 "${R50[@]}" --devices 0 --precision bf16 --channels-last
train default-bf16-cl 0 --set train.precision=bf16 --set train.channels_last=true
gpu_test conv cudnn_matches "$(limit)"
finish
