"""Where the GPU time of one sharedprefix step goes (and of the plain step), for tuning on a CUDA machine.

    PYTHONPATH=src python3 scripts/gpu_profile.py [P T G]

Prints the wall time, the summed kernel time (the gap is time the GPU waits for the host), and the kernels by
total time, for the GPU benchmark's model (Qwen3-4B layer shapes, 4 layers, bf16).
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sharedprefix.tools import bench


def _profile(name, fn, rows=25):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    print(f"\n== {name}: wall {wall:.3f} s, kernels {kernel:.3f} s ({kernel / wall:.0%} of wall)")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def main():
    P, T, G = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 512, 16)
    model = bench.bench_model(dtype=torch.bfloat16, **bench.GPU_MODEL).cuda()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    groups = [bench.make_groups(1, P, T, G, vocab=151936)[0]]
    print(f"P={P} T={T} G={G}")
    _profile("sharedprefix", lambda: bench.shared_step(model, groups))
    _profile("plain", lambda: bench.plain_step(model, groups), rows=12)


if __name__ == "__main__":
    main()
