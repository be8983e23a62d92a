#!/usr/bin/env bash
# The ninth session's fifth GPU call (one H200): `data.pin_memory` uploading from
# kiln's page-locked buffers on kiln's own stream (the fourth call found cubecl's
# `create` copying every batch into a fresh heap buffer first, pinned or not: 25 ms of
# the ResNet-50 upload's 40). The GPU test of the upload, ResNet-50 and ResNet-18 in
# turns without and with pin_memory, then the default config to the end with
# pin_memory in the time left. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and the fourth
# call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout 60 /tmp/kiln-test --ignored pinned_upload --test-threads 1 > "$RES/test-pinned.log" 2>&1
log "test pinned done ($?)"
pin_turns 3 r50 "${R50[@]}" --devices 0
pin_turns 2 r18 "${R18[@]}" --devices 0
train default-pin 0 --set data.pin_memory=true
finish
