"""Host-to-device copies on this machine, through PyTorch: the reference for kiln's
upload (`data.pin_memory`). Prints JSON: median milliseconds of a pageable upload, a
pinned upload, and a host copy from pageable into pinned memory, for one batch size.

    python3 bench/pytorch_h2d.py --mb 77
"""
import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=77.0, help="batch size in MB (float32)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    n = int(args.mb * 1e6 / 4)
    dev = torch.device("cuda", 0)
    pageable = torch.randn(n)
    pinned = torch.empty(n).pin_memory()
    out = torch.empty(n, device=dev)

    def upload(src: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def host_copy() -> float:
        t = time.perf_counter()
        pinned.copy_(pageable)
        return (time.perf_counter() - t) * 1e3

    result = {"mb": args.mb, "torch_threads": torch.get_num_threads()}
    for name, f in [("pageable_upload_ms", lambda: upload(pageable)),
                    ("pinned_upload_ms", lambda: upload(pinned)),
                    ("host_copy_into_pinned_ms", host_copy)]:
        f()
        result[name] = round(statistics.median(f() for _ in range(args.repeats)), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
