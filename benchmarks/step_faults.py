"""Page faults of a step against whole groups on the CPU: how much of the time between them is the C library's
allocator (``docs/trl.md``, "Optimizer steps").

One optimizer step over TRL-style shuffled microbatches with the graph kept, as TRL runs it in one process
(``sp.logprobs(defer=False)`` on each ``sp.plan_step`` microbatch, then ``.backward()``), against a call per whole
group the same way; bench model (hidden 512, 4 layers, vocab 32,000, float32), 4 groups of 8 completions of 8
tokens under 192-token prompts, microbatches of 8 rows. Per round and setting: process CPU seconds, of them user and
system time, and minor page faults (``getrusage``). glibc maps blocks above its mmap threshold afresh unless its heap
can serve them; compare a run with freed memory kept for reuse, as a GPU's caching allocator keeps it:

  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_faults.py
  MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 PYTHONPATH=src OMP_NUM_THREADS=1 \\
    python benchmarks/step_faults.py
"""

from __future__ import annotations

import resource
import sys
import time

import torch

import sharedprefix as sp
from sharedprefix.tools.bench import bench_loss, bench_model, make_groups

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from step_memory import microbatches  # noqa: E402


def main(rounds: int = 3) -> None:
    torch.set_num_threads(1)
    model = bench_model(dtype=torch.float32, vocab_size=32000).train()
    groups = make_groups(4, 192, 8, 8, vocab=model.config.vocab_size)
    mbs = microbatches(groups, 8)

    def backward(source):
        bench_loss(sp.logprobs(model, source, defer=False)).backward()

    def step():
        s = sp.plan_step(model, mbs)
        for k in range(len(mbs)):
            backward(s.microbatch(k))

    def whole_groups():
        for g in groups:
            backward([g])

    settings = {"step": step, "whole groups": whole_groups}
    for fn in settings.values():  # warm-up, and .grad allocated
        fn()
    print("| round | setting | CPU s | user s | system s | minor page faults |")
    print("|---|---|---|---|---|---|")
    for r in range(rounds):
        for name, fn in settings.items():
            model.zero_grad(set_to_none=False)
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            fn()
            seconds, after = time.process_time() - t0, resource.getrusage(resource.RUSAGE_SELF)
            user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
            faults = after.ru_minflt - before.ru_minflt
            print(f"| {r} | {name} | {seconds:.3f} | {user:.3f} | {system:.3f} | {faults} |", flush=True)


if __name__ == "__main__":
    main()
