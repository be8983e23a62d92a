#!/usr/bin/env python3
"""PyTorch reference for `kiln bench`: the same network, batch, resolution, optimizer
and synthetic data, timed the same way (first step, second step, then the mean of
--steps steps after --warmup, one synchronisation at the end).

torchvision ResNets; at 64 px and below the stem is kiln's `small` stem (3x3 conv,
stride 1, no max-pool), as kiln's `stem = "auto"` does. Prints one JSON line.

    python3 bench/pytorch_reference.py --model resnet18 --image-size 32 --batch 256
    python3 bench/pytorch_reference.py --model resnet50 --image-size 224 --batch 256 \
        --precision bf16 --channels-last

Several GPUs: DistributedDataParallel under torchrun, --batch per GPU (as `kiln bench
--batch`), img/s over all GPUs, printed by rank 0:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 \
        bench/pytorch_reference.py --model resnet18 --image-size 32 --batch 256
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torchvision


def build(model: str, image_size: int, classes: int) -> nn.Module:
    net = getattr(torchvision.models, model)(num_classes=classes)
    if image_size <= 64:
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    return net


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true")
    # cuDNN times its candidate algorithms for each new shape and keeps the fastest,
    # instead of taking its heuristics' first choice (PyTorch's default, and kiln's).
    p.add_argument("--cudnn-benchmark", action="store_true")
    # Also writes each CUDA kernel of three more steps (name, microseconds) as JSON.
    p.add_argument("--profile", metavar="FILE")
    args = p.parse_args()

    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Under torchrun, DDP even for one process (what its all-reduce costs alone).
    ddp = "LOCAL_RANK" in os.environ
    if ddp:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    classes = 1000 if args.image_size > 64 else 10
    net = build(args.model, args.image_size, classes).to(dev)
    mem_format = torch.channels_last if args.channels_last else torch.contiguous_format
    net = net.to(memory_format=mem_format)
    if ddp:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[dev.index])
    if args.compile:
        net = torch.compile(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    # Host batch uploaded every step, like kiln bench.
    x_host = torch.randn(args.batch, 3, args.image_size, args.image_size).pin_memory()
    y_host = torch.randint(0, classes, (args.batch,)).pin_memory()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")

    def step() -> None:
        x = x_host.to(dev, non_blocking=True).to(memory_format=mem_format)
        y = y_host.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def timed() -> float:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    first, second = timed(), timed()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / args.steps
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        if rank == 0:
            with open(args.profile, "w") as f:
                json.dump({"steps": 3, "kernels": kernels}, f)
    # What nvidia-smi shows in use on the GPU (the process's CUDA context and libraries
    # too), as kiln bench's memory_in_use_mib does.
    free, total = torch.cuda.mem_get_info()
    if ddp:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    print(json.dumps({
        "framework": f"pytorch {torch.__version__}",
        "model": args.model,
        "image_size": args.image_size,
        "batch": args.batch * world,
        "gpus": world,
        "ddp": ddp,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "cudnn_benchmark": args.cudnn_benchmark,
        "first_step_s": round(first, 3),
        "second_step_s": round(second, 3),
        "step_ms": round(step_s * 1e3, 3),
        "img_per_s": round(args.batch * world / step_s, 1),
        "max_memory_reserved_mib": torch.cuda.max_memory_reserved() // 2**20,
        "memory_in_use_mib": (total - free) // 2**20,
        "device": torch.cuda.get_device_name(0),
    }))


if __name__ == "__main__":
    main()
