#!/usr/bin/env bash
# The ninth session's second GPU call (one H200): uploads from kiln's own pool of
# page-locked buffers (`data.pin_memory`; the first call's version, through cubecl's
# staging buffers, made ResNet-50 slower). The GPU test of the pinned upload, then
# ResNet-50 and ResNet-18 benches in turns without and with pin_memory, the default
# config to the end with pin_memory, and the cuDNN convolution test against Burn's
# kernels with the time left (not with NO_CONV_TEST set). Needs .gpu/kiln.xz,
# .gpu/kiln-test.xz and the first call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
gpu_test pinned pinned_upload 60
pin_turns 3 r50 "${R50[@]}" --devices 0
pin_turns 2 r18 "${R18[@]}" --devices 0
train default-pin 0 --set data.pin_memory=true
[ -z "${NO_CONV_TEST:-}" ] && [ "$(left)" -gt 60 ] && gpu_test conv cudnn_matches "$(limit)"
finish
