"""The step's speed without a trainer around it: one optimizer step over a trainer's own microbatches, as
``sp.plan_step`` runs it (each prompt once per step), against the plain per-row run of the same microbatches, a call
per microbatch (each prompt once per microbatch) and a call per whole group (what regrouping the microbatches would
give), in one process, interleaved, on the CPU or a CUDA GPU.

The layout is TRL's default with accumulation: groups of G completions, their rows shuffled into microbatches of
``rows`` rows each (``benchmarks/step_memory.py``'s ``microbatches``), so that a group falls across G / rows
microbatches or more. Every prompt has P tokens and every completion T (no padding in the plain run, so its FLOPs
are those of its rows). Per shape: seconds per optimizer step (best of ``--repeats`` after a warm-up, the four
settings interleaved; on one CPU thread the process's CPU time, so other processes do not inflate it), tokens
computed per step against the ideal (every prompt once, every completion token once), the plain run's time over
each setting's, and that speed-up over the FLOP ratio (plain / each prompt once: ``tools.bench.flops``), the
fraction of the arithmetic saving the time keeps. On CUDA also each setting's peak allocated bytes over the level
after set-up. Short completions are the step's worst case: its microbatch passes are then small, and a pass's fixed
costs weigh most. Run:

  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_speed.py > benchmarks/step_speed_cpu.txt
  PYTHONPATH=src python benchmarks/step_speed.py --device cuda  # (scripts/dev gpu-check runs it: ``--only step``)
"""

from __future__ import annotations

import argparse
import sys

import torch

import sharedprefix as sp
from sharedprefix.tools.bench import bench_loss, bench_model, flops, make_groups, plain_rows_step
from sharedprefix.tools.bench_long import TINY_MODEL  # --tiny: the format on any machine in seconds
from sharedprefix.tools.timing import best_interleaved, cpu_clock, sync_device

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from step_memory import microbatches  # noqa: E402

# (groups, P, T, G, rows a microbatch): the TRL benchmark's shape at three completion lengths, and the seed's case,
# groups larger than a microbatch under a long prompt
CPU_SHAPES = [(4, 192, 8, 8, 8), (4, 192, 64, 8, 8), (4, 192, 256, 8, 8), (2, 1024, 64, 16, 4)]
CUDA_SHAPES = [(8, 1024, 16, 8, 8), (8, 1024, 256, 8, 8), (8, 4096, 256, 16, 8), (4, 8192, 512, 16, 4)]
SETTINGS = ["plain", "per microbatch", "step", "whole groups"]


def runs(model, groups, mbs) -> dict:
    """{setting: a callable running one optimizer step of it, returning its tokens computed}."""

    def plain():
        for mb in mbs:
            plain_rows_step(model, [(g.prompt, c) for g in mb for c in g.completions])
        return sum((g.prompt.numel() + c.numel()) for mb in mbs for g in mb for c in g.completions)

    def per_microbatch():
        return sum(sp.backward(model, mb, bench_loss).tokens_computed for mb in mbs)

    def step():
        s = sp.plan_step(model, mbs)
        return sum(sp.backward(model, s.microbatch(k), bench_loss).tokens_computed for k in range(len(mbs)))

    def whole_groups():
        return sum(sp.backward(model, [g], bench_loss).tokens_computed for g in groups)

    return dict(zip(SETTINGS, (plain, per_microbatch, step, whole_groups)))


def measure(model, shape, repeats: int, cuda: bool) -> dict:
    n, p, t, g, rows = shape
    groups = make_groups(n, p, t, g, vocab=model.config.vocab_size)
    mbs = microbatches(groups, rows)
    fns = runs(model, groups, mbs)
    zero = lambda: model.zero_grad(set_to_none=False)  # noqa: E731  (.grad kept allocated, outside the peak)
    for fn in fns.values():  # warm-up, and .grad allocated
        fn()
    zero()
    best = best_interleaved([(k, fn) for _ in range(repeats) for k, fn in fns.items()], zero, cpu_clock(cuda))
    peak = {}
    if cuda:
        for k, fn in fns.items():
            zero()
            sync_device()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            sync_device()
            peak[k] = torch.cuda.max_memory_allocated() - base
    ideal = n * (p + g * t)
    ratio = flops(model.config, groups, shared=False) / flops(model.config, groups, shared=True)
    return dict(best=best, peak=peak, ideal=ideal, flop_ratio=ratio, microbatches=len(mbs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default=None, help="groups,P,T,G,rows;... (default: the device's table)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (2 layers, hidden 32): checks the format only")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = bench_model(dtype=dtype, **(TINY_MODEL if args.tiny else dict(vocab_size=32000))).to(device).train()
    shapes = CUDA_SHAPES if cuda else CPU_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    cfg = model.config
    where = torch.cuda.get_device_name(device) if cuda else "cpu, one thread (process CPU time)"
    print(
        f"sp.plan_step against the plain per-row run of the same microbatches; bench model (Qwen3, hidden "
        f"{cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}), "
        f"{str(dtype).replace('torch.', '')}, {where}; torch {torch.__version__}; best of {args.repeats}, interleaved"
    )
    head = (
        "| groups x P / T / G / rows (microbatches) | setting | s/step | tokens / ideal | plain / it | of FLOP ratio |"
    )
    print(head + (" peak MiB |" if cuda else ""))
    print("|---" * (7 if cuda else 6) + "|")
    for shape in shapes:
        r = measure(model, shape, args.repeats, cuda)
        n, p, t, g, rows = shape
        plain_s = r["best"]["plain"][0]
        for k in SETTINGS:
            s, tokens = r["best"][k]
            speed = plain_s / s
            line = (
                f"| {n} x {p} / {t} / {g} / {rows} ({r['microbatches']}) | {k} | {s:.3f} | "
                f"{tokens / r['ideal']:.2f} | {speed:.2f} | {speed / r['flop_ratio']:.2f} |"
            )
            print(line + (f" {r['peak'][k] / 2**20:.0f} |" if cuda else ""), flush=True)
        step, whole = r["best"]["step"][0], r["best"]["whole groups"][0]
        print(
            f"{n} x {p} / {t} / {g} / {rows}: FLOP ratio plain / step {r['flop_ratio']:.2f}; step / whole groups "
            f"{step / whole:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
