#!/usr/bin/env bash
# The eighth session's second GPU call (one H200): the default config to the end with
# cuDNN's batch norm (accuracy against the seventh session's 94.28%), the ignored
# cuDNN convolution test (the convolution now goes through the launcher it shares with
# batch norm), ResNet-50 with Burn's batch-norm operations for the before/after, the
# PyTorch bf16 + channels_last references of issue 7's goal, and ResNet-18 with
# gradient checkpointing (batch norm's recomputation in the backward pass). See lib.sh.
set -u
source "$(dirname "$0")/lib.sh"
train fp32 0
xz -dc .gpu/kiln-test.xz > /tmp/kiln-test && chmod +x /tmp/kiln-test
timeout 220 /tmp/kiln-test --ignored cudnn_matches --test-threads 1 > "$RES/test-cudnn.log" 2>&1
log "test cudnn done ($?)"
CAP=100 bench r50-burn-bn "${R50[@]}" --devices 0 --set train.batch_norm=burn
CUDA_VISIBLE_DEVICES=0 torch r18-bf16-cl "${R18[@]}" --precision bf16 --channels-last
CUDA_VISIBLE_DEVICES=0 torch r50-bf16-cl "${R50[@]}" --precision bf16 --channels-last
CAP=60 bench r18-ckpt "${R18[@]}" --devices 0 --set train.gradient_checkpointing=true
CAP=60 bench r18-again "${R18[@]}" --devices 0
finish
