#!/usr/bin/env bash
# On a GPU machine: what comes after a run. Trains the default config, exports its best
# checkpoint and evaluates the export in torchvision beside kiln's own evaluation,
# classifies a few test images with `kiln predict`, and reads the run's TensorBoard
# events with TensorBoard's own reader.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
ktrain default train --config configs/resnet.toml
run=$(ls -d /tmp/runs/default/*/ | head -1)
ls -la "$run" > "$RES/run-dir.txt"
"$K" export --run "$run" --output /tmp/resnet18.safetensors > "$RES/export.txt" 2>&1
log "export: exit $? $(head -1 "$RES/export.txt")"
python3 bench/torchvision_check.py /tmp/resnet18.safetensors datasets/fashion-mnist > "$RES/torchvision.json" 2> "$RES/torchvision.log"
log "torchvision: exit $? $(cat "$RES/torchvision.json")"
"$K" eval --run "$run" --checkpoint best > "$RES/eval.txt" 2>&1
log "kiln eval: $(tail -1 "$RES/eval.txt")"
# Eight test images as PNG files, named by their true class.
python3 - <<'PY'
import gzip, os
import numpy as np
from PIL import Image
names = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
raw = gzip.open("datasets/fashion-mnist/t10k-images-idx3-ubyte.gz").read()[16:]
labels = gzip.open("datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz").read()[8:]
os.makedirs("/tmp/pngs", exist_ok=True)
for i in range(8):
    img = np.frombuffer(raw, np.uint8, 784, 784 * i).reshape(28, 28)
    Image.fromarray(img).save(f"/tmp/pngs/{i}-{names[labels[i]]}.png")
PY
"$K" predict --run "$run" /tmp/pngs > "$RES/predict.txt" 2> "$RES/predict.log"
log "predict: exit $?"; cat "$RES/predict.txt" | tee -a "$RES/log.txt"
"$K" predict --run "$run" --json --top-k 2 /tmp/pngs/0-boot.png > "$RES/predict.json" 2>> "$RES/predict.log"
python3 - "$run" > "$RES/tensorboard.txt" 2>&1 <<'PY'
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
ea.Reload()
for tag in ea.Tags()["scalars"]:
    s = ea.Scalars(tag)
    print(f"{tag}: {len(s)} points, steps {s[0].step}-{s[-1].step}, last {s[-1].value:.4g}")
PY
log "tensorboard reader: exit $?"; cat "$RES/tensorboard.txt" | tee -a "$RES/log.txt"
[ -n "${KEEP:-}" ] || finish
