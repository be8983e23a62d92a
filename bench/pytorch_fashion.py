#!/usr/bin/env python3
"""PyTorch reference for kiln's default config (configs/resnet.toml), written as users
usually write it: torchvision's ResNet-18 with the small-image stem (3x3 conv, stride 1,
no max-pool) on the bundled Fashion-MNIST, 2 px padded random crop and horizontal flip,
a DataLoader with 4 workers, batch 256, SGD (momentum 0.9, Nesterov, weight decay 5e-4),
lr 0.1 with a one-epoch linear warmup and a cosine decay over the steps, 12 epochs, a
test pass after every epoch. Prints one JSON line per epoch and one at the end (test
accuracy, wall time).

    python3 bench/pytorch_fashion.py --root datasets/fashion-mnist [--epochs 12]
"""
import argparse
import gzip
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torchvision

MEAN, STD = 0.2860, 0.3530


def idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def split(root: str, prefix: str):
    find = lambda stem: next(
        os.path.join(root, f) for f in os.listdir(root) if f.startswith(stem)
    )
    images = idx(find(f"{prefix}-images"))
    labels = idx(find(f"{prefix}-labels"))
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


class Train(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].float().div(255).sub(MEAN).div(STD).unsqueeze(0)
        x = nn.functional.pad(x, (2, 2, 2, 2))
        dy, dx = torch.randint(0, 5, (2,)).tolist()
        x = x[:, dy : dy + 28, dx : dx + 28]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.labels[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=4)
    a = p.parse_args()
    start = time.time()
    dev = torch.device("cuda")
    train_x, train_y = split(a.root, "train")
    test_x, test_y = split(a.root, "t10k")
    loader = torch.utils.data.DataLoader(
        Train(train_x, train_y),
        batch_size=a.batch,
        shuffle=True,
        drop_last=True,
        num_workers=a.num_workers,
        pin_memory=True,
        persistent_workers=True,
    )
    test = test_x.float().div(255).sub(MEAN).div(STD).unsqueeze(1).to(dev)
    test_y = test_y.to(dev)
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    net = net.to(dev)
    opt = torch.optim.SGD(
        net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    steps = len(loader) * a.epochs
    warm = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warm
        if s < warm
        else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))),
    )
    loss_fn = nn.CrossEntropyLoss()
    acc = 0.0
    for epoch in range(a.epochs):
        net.train()
        t = time.time()
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        net.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(test_y), 1000):
                correct += (net(test[i : i + 1000]).argmax(1) == test_y[i : i + 1000]).sum().item()
        acc = correct / len(test_y)
        print(json.dumps({"epoch": epoch + 1, "test_acc": acc, "epoch_s": time.time() - t}), flush=True)
    print(json.dumps({"final_test_acc": acc, "wall_s": time.time() - start}), flush=True)


if __name__ == "__main__":
    main()
