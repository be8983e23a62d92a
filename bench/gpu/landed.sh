#!/usr/bin/env bash
# The ninth session's seventh GPU call (one H200): the landed build after its last
# clean-up (cuDNN's scaling factors and batch norm's outputs through one helper each):
# the GPU tests of batch norm and the pinned upload, the default config to the end with
# the defaults, and one ResNet-50 bench. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and the
# sixth call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
gpu_test pinned pinned_upload 60
gpu_test bn cudnn_batch_norm 60
train default 0
CAP=40 bench r50 "${R50[@]}" --devices 0
finish
