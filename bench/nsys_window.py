#!/usr/bin/env python3
"""Where the GPU's time goes in the last `steps` steps of an Nsight Systems capture.

    nsys_window.py CAPTURE.sqlite STEP_MS STEPS

The window is the `steps` x `STEP_MS` before the capture's last GPU activity (run the
bench with `--breakdown-steps 0`, so that its timed steps end the capture). Prints the
fraction of the window the GPU is busy (kernels and copies, overlaps counted once),
kernel time by name, copies, and the CUDA API calls the host made in the window.
"""
import re
import sqlite3
import sys
from collections import defaultdict


def union(intervals):
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def table(db, name):
    return db.execute(
        "select count(*) from sqlite_master where type='table' and name=?", (name,)
    ).fetchone()[0]


def main():
    db = sqlite3.connect(sys.argv[1])
    step_ms, steps = float(sys.argv[2]), int(sys.argv[3])
    strings = dict(db.execute("select id, value from StringIds"))
    kernels = db.execute(
        "select start, end, shortName from CUPTI_ACTIVITY_KIND_KERNEL"
    ).fetchall()
    copies = []
    if table(db, "CUPTI_ACTIVITY_KIND_MEMCPY"):
        copies = db.execute(
            "select start, end, copyKind, bytes from CUPTI_ACTIVITY_KIND_MEMCPY"
        ).fetchall()
    last = max(e for _, e, *_ in kernels + copies)
    lo = last - steps * step_ms * 1e6
    win_k = [(max(s, lo), e, strings.get(n, str(n))) for s, e, n in kernels if e > lo]
    win_c = [(max(s, lo), e, k, b) for s, e, k, b in copies if e > lo]
    span = last - lo
    busy = union([(s, e) for s, e, _ in win_k] + [(s, e) for s, e, _, _ in win_c])
    per = lambda ns: ns / 1e6 / steps
    print(f"window: {steps} steps x {step_ms:.1f} ms; GPU busy {per(busy):.1f} ms/step "
          f"({100 * busy / span:.0f}%), idle {per(span - busy):.1f} ms/step")
    by_name = defaultdict(lambda: [0, 0])
    for s, e, n in win_k:
        by_name[n][0] += e - s
        by_name[n][1] += 1
    groups = defaultdict(lambda: [0, 0])
    for n, (t, c) in by_name.items():
        g = ("cudnn/cutlass" if re.search(r"cudnn|xmma|cutlass|sm\d\d_|convolve|nchw|nhwc|implicit|winograd|fft|gemm", n, re.I)
             else "cubecl")
        groups[g][0] += t
        groups[g][1] += c
    for g, (t, c) in sorted(groups.items(), key=lambda x: -x[1][0]):
        print(f"  {g:14s} {per(t):8.2f} ms/step  {c / steps:7.1f} launches/step")
    print("top kernels (ms/step, launches/step):")
    for n, (t, c) in sorted(by_name.items(), key=lambda x: -x[1][0])[:25]:
        print(f"  {per(t):8.2f}  {c / steps:6.1f}  {n[:110]}")
    kinds = defaultdict(lambda: [0, 0, 0])
    for s, e, k, b in win_c:
        kinds[k][0] += e - s
        kinds[k][1] += 1
        kinds[k][2] += b
    for k, (t, c, b) in kinds.items():
        print(f"copies kind {k}: {per(t):.2f} ms/step, {c / steps:.1f}/step, {b / steps / 2**20:.1f} MiB/step")
    if table(db, "CUPTI_ACTIVITY_KIND_RUNTIME"):
        api = defaultdict(lambda: [0, 0])
        for s, e, n in db.execute(
            "select start, end, nameId from CUPTI_ACTIVITY_KIND_RUNTIME where end > ?", (lo,)
        ):
            api[strings.get(n, str(n))][0] += e - max(s, lo)
            api[strings.get(n, str(n))][1] += 1
        print("host API calls in the window (ms/step, calls/step):")
        for n, (t, c) in sorted(api.items(), key=lambda x: -x[1][0])[:15]:
            print(f"  {per(t):8.2f}  {c / steps:7.1f}  {n}")


if __name__ == "__main__":
    main()
