#!/usr/bin/env bash
# Thirteenth session, call 3 (one H200): BatchNorm's running statistics as one kernel
# per layer (`ops/norm_kernels.rs`; .gpu/kiln.xz) against a dozen operations per
# layer (.gpu/kiln-bn.xz, call 1's build), ResNet-50 and -18 bf16 channels-last in
# turns; then the running-statistics kernel's GPU test. See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
watch_gpu
xz -dc .gpu/kiln-bn.xz > /tmp/kiln-bn && chmod +x /tmp/kiln-bn
KR=$K
for round in 1 2; do
  for m in r50-bf16-cl r18-bf16-cl; do
    case $m in
      r50-bf16-cl) a=("${R50[@]}" --precision bf16 --channels-last); cap=40 ;;
      r18-bf16-cl) a=("${R18[@]}" --precision bf16 --channels-last); cap=30 ;;
    esac
    K=$KR CAP=$cap bench $m-running-$round "${a[@]}" --devices 0
    K=/tmp/kiln-bn CAP=$cap bench $m-ops-$round "${a[@]}" --devices 0
  done
done
K=$KR
gpu_test running running_statistics 60
gpu_test channels-last-norm channels_last_kernels 60
finish
