#!/usr/bin/env bash
# The ninth session's fifth GPU call (one H200): `data.pin_memory` uploading from
# kiln's page-locked buffers on kiln's own stream (the fourth call found cubecl's
# `create` copying every batch into a fresh heap buffer first, pinned or not: 25 ms of
# the ResNet-50 upload's 40). The GPU test of the upload, ResNet-50 and ResNet-18 in
# turns without and with pin_memory, then the default config to the end with
# pin_memory in the time left. Needs .gpu/kiln.xz, .gpu/kiln-test.xz and the fourth
# call's .gpu/caches.tar.xz. The steps of pinned-pool.sh (the same experiment on the
# second call's build), without its convolution test. See lib.sh.
NO_CONV_TEST=1 exec bash "$(dirname "$0")/pinned-pool.sh"
