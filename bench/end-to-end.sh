#!/usr/bin/env bash
# On a GPU machine: the default config to the end, kiln beside the same recipe in PyTorch with a DataLoader.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
ktrain default train --config configs/resnet.toml --devices 0
[ "$(left)" -gt 90 ] && timeout "$(limit)" python3 bench/pytorch_fashion.py --root datasets/fashion-mnist > "$RES/torch-default.json" 2> "$RES/torch-default.log"
log "torch default: $(tail -n 1 "$RES/torch-default.json" 2> /dev/null)"
[ -n "${KEEP:-}" ] || finish
