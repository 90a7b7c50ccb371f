#!/usr/bin/env python3
"""A reference for the decode GEMMs' DRAM floor, independent of megamoe's kernels (device machine).

Times PyTorch's full reduction (torch.sum over an int64 tensor: a plain read of every byte) of as
many bytes as the qwen3-30b-a3b FC1 / FC2 and deepseek-v3 FC2 expert weight sets, after the same two
L2 flushes as `megamoe bench-gemm --flush`: read (256 MiB read, L2 left clean) and memset (256 MiB
written, L2 left dirty). Kernel times come from the CUDA profiler (CUPTI), so launch gaps are not
counted.
  python3 scripts/device_read_floor.py [iters]
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20
dev = torch.device("cuda")
flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
flush_buf.fill_(1)
cases = {
    "qwen3 FC2 weights 64 x 2048 x 768": 64 * 2048 * 768,
    "qwen3 FC1 weights 64 x 1536 x 2048": 64 * 1536 * 2048,
    "deepseek-v3 FC2 weights 32 x 7168 x 2048": 32 * 7168 * 2048,
}
print(torch.cuda.get_device_name(0), "torch", torch.__version__)
failed = 0
for flush in ("read", "memset"):
    for name, nbytes in cases.items():
        w = torch.randint(-2**31, 2**31 - 1, (nbytes // 8,), dtype=torch.int64, device=dev)
        for _ in range(3):
            torch.sum(w)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                if flush == "read":
                    flush_buf.view(torch.float32).sum()  # a float reduction: told apart by name
                else:
                    flush_buf.zero_()
                torch.cuda.synchronize()
                torch.sum(w)
                torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names = {}
        for e in ev:
            names[e.name] = names.get(e.name, 0) + 1
        # the measured sums are the int64 ("long") reductions; the read flush reduces floats
        measured = [e for e in ev if "long" in e.name]
        durs = [e.time_range.elapsed_us() for e in measured]
        if len(durs) != iters:
            print(f"  unexpected kernel list ({len(durs)} int64 reductions for {iters} iterations):")
            for n, c in names.items():
                print(f"    {c:4d} x {n[:150]}")
            failed += 1
            continue
        durs = sorted(durs)
        med = statistics.median(durs)
        print(f"flush {flush:6s} {name:42s} {nbytes / 1e6:8.1f} MB  kernel us med {med:7.2f} min {durs[0]:7.2f}"
              f"  -> {nbytes / med / 1e6:5.2f} TB/s (med), {nbytes / durs[0] / 1e6:5.2f} (min)  n={len(durs)}")
sys.exit(1 if failed else 0)
