#!/usr/bin/env python3
"""Loads a `kiln export` file into torchvision's ResNet with strict=True and evaluates it
on Fashion-MNIST's (or MNIST's) test set in IDX form; prints one JSON line with the
accuracy beside the one kiln recorded for the checkpoint.

    python3 bench/torchvision_check.py MODEL.safetensors datasets/fashion-mnist
"""
import argparse
import json
import os

import numpy as np
import safetensors
import safetensors.torch
import torch
import torchvision

from pytorch_fashion import idx  # the IDX reader beside this script


def find(root, stem):
    for name in (stem + ".gz", stem):
        if os.path.exists(os.path.join(root, name)):
            return os.path.join(root, name)
    raise SystemExit(f"{root}: no {stem}[.gz]")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("idx_dir")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    meta = safetensors.safe_open(a.model, "pt").metadata()
    channels, height, width = json.loads(meta["input_shape"])
    builder = getattr(torchvision.models, meta["arch"])
    model = builder(num_classes=int(meta["num_classes"]))
    if meta["stem"] == "small":
        model.conv1 = torch.nn.Conv2d(channels, 64, 3, 1, 1, bias=False)
        model.maxpool = torch.nn.Identity()
    elif channels != 3:
        model.conv1 = torch.nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
    model.load_state_dict(safetensors.torch.load_file(a.model), strict=True)
    model = model.to(a.device).eval()

    images = idx(find(a.idx_dir, "t10k-images-idx3-ubyte")).astype(np.float32) / 255.0
    labels = torch.from_numpy(idx(find(a.idx_dir, "t10k-labels-idx1-ubyte")).astype(np.int64))
    mean = torch.tensor(json.loads(meta["mean"])).view(1, -1, 1, 1)
    std = torch.tensor(json.loads(meta["std"])).view(1, -1, 1, 1)
    x = (torch.from_numpy(images).unsqueeze(1) - mean) / std
    if x.shape[-2:] != (height, width):
        x = torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear")
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            out = model(x[i:i + 1000].to(a.device))
            correct += (out.argmax(1).cpu() == labels[i:i + 1000]).sum().item()
    print(json.dumps({
        "file": a.model,
        "arch": meta["arch"],
        "strict_load": True,
        "images": len(x),
        "torchvision_accuracy": correct / len(x),
        "kiln_test_accuracy": float(meta.get("test_accuracy", "nan")),
        "classes": json.loads(meta["classes"]),
    }))


if __name__ == "__main__":
    main()
