#!/usr/bin/env python3
"""PyTorch reference for kiln's loading study: ResNet-18 (small stem) trained on an
image folder (ROOT/train/CLASS/*.jpg) with kiln's CIFAR-10 augmentation (4 px padded
random crop, horizontal flip, normalisation), torchvision's ImageFolder and DataLoader
with --num-workers and --pin-memory. Prints one JSON line per epoch: img/s and the
share of the epoch the training loop waited for a batch (kiln's `data_wait_s`).

    python3 bench/pytorch_loading.py --root /tmp/cifar --num-workers 4 --pin-memory
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as T


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--pin-memory", action="store_true")
    args = p.parse_args()

    torch.manual_seed(0)
    dev = torch.device("cuda")
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    net = net.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    augment = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    ])
    data = torchvision.datasets.ImageFolder(f"{args.root}/train", transform=augment)
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.batch, shuffle=True, drop_last=True,
        num_workers=args.num_workers, pin_memory=args.pin_memory,
        persistent_workers=args.num_workers > 0,
    )
    for epoch in range(1, args.epochs + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        wait, images = 0.0, 0
        batches = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            wait += time.perf_counter() - t
            x = x.to(dev, non_blocking=args.pin_memory)
            y = y.to(dev, non_blocking=args.pin_memory)
            loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            images += x.shape[0]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(json.dumps({
            "framework": f"pytorch {torch.__version__}",
            "epoch": epoch,
            "num_workers": args.num_workers,
            "pin_memory": args.pin_memory,
            "images": images,
            "epoch_s": round(seconds, 3),
            "img_per_s": round(images / seconds, 1),
            "data_wait_share": round(wait / seconds, 3),
        }), flush=True)


if __name__ == "__main__":
    main()
