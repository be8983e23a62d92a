#!/usr/bin/env bash
# The ninth session's third GPU call (one H200): where a pinned upload's time goes.
# The bench's upload phase split into the uploading thread's own time (the copy into
# page-locked memory, now on several threads) and the transfer; ResNet-50 and
# ResNet-18 in turns without and with `data.pin_memory`; PyTorch's pageable and pinned
# uploads of the same 77 MB beside them (bench/pytorch_h2d.py). Needs .gpu/kiln.xz and
# the second call's .gpu/caches.tar.xz. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
python3 bench/pytorch_h2d.py --mb 77 > "$RES/torch-h2d.json" 2> "$RES/torch-h2d.log"
log "torch h2d done ($?)"
pin_turns 3 r50 "${R50[@]}" --devices 0
pin_turns 2 r18 "${R18[@]}" --devices 0
CUDA_VISIBLE_DEVICES=0 torch r50 "${R50[@]}"
finish
