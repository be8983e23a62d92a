#!/usr/bin/env bash
# On a GPU machine: the GPU tests (cuDNN, kiln's kernels, page-locked uploads, NCCL), which the CPU suite ignores.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
timeout "$(limit)" "$T" --ignored --test-threads 1 > "$RES/gpu-tests.log" 2>&1
log "gpu tests: exit $? $(grep -E '^test result' "$RES/gpu-tests.log")"
grep -E '^test .* (ok|FAILED)$' "$RES/gpu-tests.log" | tee -a "$RES/log.txt"
[ -n "${KEEP:-}" ] || finish
