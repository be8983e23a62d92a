#!/usr/bin/env bash
# The ninth session's second GPU call (one H200): uploads from kiln's own pool of
# page-locked buffers (`data.pin_memory`; the first call's version, through cubecl's
# staging buffers, made ResNet-50 slower). The GPU test of the pinned upload, then
# ResNet-50 and ResNet-18 benches in turns without and with pin_memory, the default
# config to the end with pin_memory, and the cuDNN convolution test against Burn's
# kernels with the time left. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and the first
# call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout 60 /tmp/kiln-test --ignored pinned_upload --test-threads 1 > "$RES/test-pinned.log" 2>&1
log "test pinned done ($?)"
pin_turns 3 r50 "${R50[@]}" --devices 0
pin_turns 2 r18 "${R18[@]}" --devices 0
train default-pin 0 --set data.pin_memory=true
[ "$(left)" -gt 60 ] && timeout "$(limit)" /tmp/kiln-test --ignored cudnn_matches --test-threads 1 > "$RES/test-conv.log" 2>&1
log "test conv done ($?)"
finish
