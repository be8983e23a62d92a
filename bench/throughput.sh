#!/usr/bin/env bash
# On a GPU machine: kiln bench beside PyTorch eager and torch.compile, in turns (ResNet-50 224 px and ResNet-18 32 px, bf16 channels-last, and ResNet-18 fp32).
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
R50=(--model resnet50 --image-size 224 --batch 128 --steps 20 --warmup 5 --precision bf16 --channels-last)
R18=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10 --precision bf16 --channels-last)
F32=(--model resnet18 --image-size 32 --batch 256 --steps 50 --warmup 10 --precision fp32)
for i in ${ROUNDS:-1 2}; do
  for case in r50 r18 f32; do
    case $case in r50) a=("${R50[@]}");; r18) a=("${R18[@]}");; f32) a=("${F32[@]}");; esac
    CAP=150 kbench $case-$i "${a[@]}"
    CAP=120 tbench $case-eager-$i "${a[@]}"
    [ $case != f32 ] && CAP=150 tbench $case-compile-$i "${a[@]}" --compile
  done
done
[ -n "${KEEP:-}" ] || finish
