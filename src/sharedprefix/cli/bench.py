"""Benchmarks of sharedprefix against the plain run, measured in one process (timings) and in a
fresh subprocess per configuration (peak memory). Reported as ratios, never as timed tests.

Default (speed): forward+backward of one group, plain SDPA rows with logits only at completion
positions vs sharedprefix; Qwen3 architecture, hidden 512, 4 layers, 8 heads / 4 KV heads,
head_dim 64, intermediate 1536, vocab 32000, float32; prompt 2048, completions 128, G = 8.

--compile (tools/bench_compile.py): eager and compiled decoder layers, plain rows and sharedprefix, interleaved.

--memory: prompt 4096, completions 256, G in 4 8 16 32, budget 6144 tokens: the plain run
microbatched by whole rows under the budget; shared attention inside a pass only (a group
split across passes recomputes its prompt, as Prefix Grouper and verl do); and the
cross-microbatch schedule in each prefix_activations mode.
"""

from __future__ import annotations

import os
import sys

HELP = "speed and memory of sharedprefix against the plain run"
MB = 2**20
torch = bench = None  # imported by `run` (not for --help); `_gpu`, `_speed` and `_memory` use these names


def _import_heavy():
    global torch, bench
    import torch

    from sharedprefix.tools import bench


def _progress(total, desc):
    """A progress bar on stderr, shown only when stderr is a terminal (tqdm's disable=None)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=None, dynamic_ncols=True, file=sys.stderr)


def _out(line):
    """A result line on stdout that does not garble a progress bar on the same terminal."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def add_arguments(p):
    p.add_argument(
        "--memory",
        action="store_true",
        help="run the memory benchmark of the cross-microbatch schedule "
        "(with --tree: peak memory against the number of prompts sharing the system prompt)",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help="agentic shape: a system prompt shared by 8 prompts (trees vs "
        "per-group sharing; --max-tokens is the budget, default 8192 here; --plain adds the plain run)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="with --tree: also time the plain run (slow on CPU); with --hybrid --tree: all of it",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="a Qwen3.5-style hybrid (delta-net:attention 3:1) on the speed benchmark's group: packed, plain rows, "
        "cache path (with --tree: the agentic shape, the packed tree against plain rows and the cache path)",
    )
    p.add_argument(
        "--vision",
        action="store_true",
        help="vision-language shape: 1024 visual + 256 text prompt tokens, "
        "G=8 x 256, Qwen2-VL architecture (plain rows with their images vs sharedprefix)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="eager and compiled decoder layers (layer.compile()): plain rows and sharedprefix, four runs interleaved "
        "(tools/bench_compile.py; CPU shape: prompt 1024, G=8 x 128; on CUDA the GPU model, prompt 4096, G=8 x 512)",
    )
    p.add_argument("--prompt", type=int, default=None, help="prompt length (default 2048, or 4096 with --memory)")
    p.add_argument("--completion", type=int, default=None, help="completion length (default 128, or 256)")
    p.add_argument("--G", type=int, nargs="+", default=None, help="group size(s) (default 8, or 4 8 16 32)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="token budget (default 6144 with --memory, 8192 with --tree)"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed repeats after a warm-up (speed benchmark)")
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers of the benchmark model (default 4; 2 with --long)"
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="the long-prompt regime (tools/bench_long.py): Llama-3-8B layer shapes, P 16384 and 32768, T 1024, G 8 "
        "and 16, one budget (--max-tokens, default 16384) for plain rows, in-pass sharing and ours in each mode; then "
        "the capacity line (--capacity-layers). --prompt, --completion, --G and --tiny shrink it (the CPU test)",
    )
    p.add_argument("--tiny", action="store_true", help="with --long: tiny model shapes (for a run on the CPU)")
    p.add_argument("--capacity-layers", type=int, default=8, help="with --long: decoder layers of the capacity line")
    p.add_argument("--capacity-start", type=int, default=16384, help="with --long: the capacity line's first prompt")
    p.add_argument("--capacity-limit", type=int, default=131072, help="with --long: the capacity line's longest prompt")
    p.add_argument("--no-capacity", action="store_true", help="with --long: skip the capacity line")
    p.add_argument("--capacity-only", action="store_true", help="with --long: only the capacity line")
    p.add_argument("--modes", nargs="+", default=["plain", "in_pass", "keep", "offload", "recompute"])
    p.add_argument(
        "--dims",
        default="bench",
        choices=["bench", "qwen3.5"],
        help="with --hybrid --tree: the model's dimensions, the benchmark's tiny ones (hidden 512, vocab 32000) or "
        "transformers' default Qwen3.5 ones (hidden 4096, vocab 248320; for a GPU)",
    )
    p.add_argument("--device", default=None, help="device to run on (default: cuda when available, else cpu)")
    p.add_argument(
        "--plot",
        action="store_true",
        help="only draw docs/img/*.png from the result files in benchmarks/ (runs nothing)",
    )


def run(args):
    if args.plot:
        return _plot()
    _import_heavy()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.layers is None:
        args.layers = 2 if args.long else 4
    if args.long:
        return _long(args)
    if args.compile:
        from sharedprefix.tools import bench_compile

        shape = None
        if args.prompt or args.completion or args.G:
            P, T, G = bench_compile.CUDA_SHAPE if str(args.device).startswith("cuda") else bench_compile.CPU_SHAPE
            shape = (args.prompt or P, args.completion or T, (args.G or [G])[0])
        bench_compile.run(args.layers, args.repeats, args.device, shape, lambda line: print(line, flush=True))
        return 0
    if args.memory and args.tree:
        from sharedprefix.tools import bench_tree

        bench_tree.memory(
            args.max_tokens or 8192, args.layers, device=args.device, report=lambda line: print(line, flush=True)
        )
        return 0
    if args.memory:
        args.max_tokens = args.max_tokens or 6144
        return _memory(args)
    if args.hybrid:
        from sharedprefix.tools import bench_hybrid

        if args.tree:  # the agentic shape; --plain times every plain microbatch instead of a sample
            sample = None if args.plain else 4
            lines = bench_hybrid.tree(
                args.layers, args.repeats, args.max_tokens or 8192, sample, args.device, args.dims
            )
            print("\n".join(lines), flush=True)
            return 0
        print("\n".join(bench_hybrid.run(args.layers, args.repeats)), flush=True)
        return 0
    if args.vision:
        from sharedprefix.tools import bench_vl

        print("\n".join(bench_vl.run(args.layers)), flush=True)
        return 0
    if args.tree:
        from sharedprefix.tools import bench_tree

        budget = args.max_tokens or 8192
        print("\n".join(bench_tree.run(budget, args.layers, args.plain, args.device)), flush=True)
        return 0
    if str(args.device).startswith("cuda") and args.prompt is None:
        return _gpu(args)
    return _speed(args)


def _gpu(args):
    """The GPU grid: Qwen3-4B layer shapes, bf16, forward+backward; plain, Prefix-Grouper-style, sharedprefix."""
    model = bench.bench_model(dtype=torch.bfloat16, **{**bench.GPU_MODEL, "num_hidden_layers": args.layers})
    model = model.to(args.device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    name = torch.cuda.get_device_name()
    print(
        f"model: Qwen3-4B layer shapes (hidden 2560, 32/8 heads, head_dim 128, intermediate 9728), {args.layers} "
        f"layers, vocab 151936, bf16, {name}; forward+backward, best of {args.repeats}; peak = allocator peak over "
        "the level before the step"
    )
    print(
        f"{'P':>5} {'T':>5} {'G':>3} | {'plain s':>8} {'PG s':>8} {'ours s':>8} | {'x plain':>7} {'x PG':>6} "
        f"{'FLOP x':>6} {'0.8 FLOP':>8} | {'mem plain':>9} {'mem PG':>7} {'mem ours':>8} {'ours/plain':>10}",
        flush=True,
    )
    grid = [(P, T, G) for P in (4096, 8192) for T in (512, 1024) for G in (8, 16)]
    for P, T, G in grid:
        groups = [bench.make_groups(1, P, T, G, vocab=151936)[0]]
        plain_rows = {"n": G}  # rows per plain microbatch: the whole group, halved while it does not fit the GPU
        runs = {
            "plain": lambda groups=groups, n=plain_rows, row=P + T: bench.plain_step(model, groups, n["n"] * row),
            "ours": lambda groups=groups: bench.shared_step(model, groups),
        }

        def pg(groups=groups):
            with bench.repeated_prefix():
                bench.shared_step(model, groups)

        runs["pg"] = pg
        t, m = {}, {}
        for key, fn in runs.items():
            while key not in t:
                try:
                    t[key] = bench.best_time(fn, args.repeats)
                    m[key] = bench.cuda_peak(fn)[1]
                except torch.OutOfMemoryError:
                    if key != "plain" or plain_rows["n"] == 1:
                        t[key] = m[key] = float("nan")
                    else:
                        plain_rows["n"] //= 2
                torch.cuda.empty_cache()
        fr = bench.flops(model.config, groups, False) / bench.flops(model.config, groups, True)
        print(
            f"{P:>5} {T:>5} {G:>3} | {t['plain']:>8.3f} {t['pg']:>8.3f} {t['ours']:>8.3f} | "
            f"{t['plain'] / t['ours']:>6.2f}x {t['pg'] / t['ours']:>5.2f}x {fr:>5.2f}x "
            f"{'yes' if t['plain'] / t['ours'] >= 0.8 * fr else 'NO':>8} | {m['plain'] / MB:>9.0f} "
            f"{m['pg'] / MB:>7.0f} {m['ours'] / MB:>8.0f} {m['ours'] / m['plain']:>10.3f}"
            + (f"  (plain in microbatches of {plain_rows['n']} rows: {G} did not fit)" if plain_rows["n"] < G else ""),
            flush=True,
        )
    _gpu_dense_ablation(model, args.repeats)
    _gpu_modes(model, args.repeats)
    return 0


def _gpu_dense_ablation(model, repeats, P=8192, T=512, G=16):
    """Ours with dense dispatch on and off (every cascade call varlen) at one shape, and the dense kernel chosen."""
    from sharedprefix.attention.kernels.dense import cuda_dense, dense_dispatch

    groups = [bench.make_groups(1, P, T, G, vocab=151936)[0]]
    kernel = cuda_dense(next(model.parameters()).device, torch.bfloat16).name
    t_on = bench.best_time(lambda: bench.shared_step(model, groups), repeats)
    with dense_dispatch(False):
        t_off = bench.best_time(lambda: bench.shared_step(model, groups), repeats)
    print(
        f"\ndense dispatch at P={P}, T={T}, G={G} (dense kernel: {kernel}): on {t_on:.3f} s, off "
        f"(SHAREDPREFIX_DENSE=0, every call varlen) {t_off:.3f} s, off / on {t_off / t_on:.2f}x",
        flush=True,
    )


def _long(args):
    """The long-prompt table and the capacity line (``tools.bench_long``)."""
    from sharedprefix.tools import bench_long

    cuda = str(args.device).startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    tiny = bench_long.TINY_MODEL if args.tiny else {}
    T = args.completion or 1024
    budget = args.max_tokens or 16384
    report = lambda line: print(line, flush=True)  # noqa: E731
    if not args.capacity_only:
        shapes = [(P, T, G) for P in ([args.prompt] if args.prompt else [16384, 32768]) for G in (args.G or [8, 16])]
        model_kw = {**tiny, "num_hidden_layers": args.layers}
        bench_long.run(args.device, shapes, budget, args.repeats, report, model_kw, dtype)
    if not args.no_capacity:
        model_kw = {**tiny, "num_hidden_layers": args.capacity_layers}
        G = (args.G or [16])[-1]
        bench_long.capacity(
            args.device, args.capacity_start, T, G, args.capacity_limit, budget, report, model_kw, dtype
        )
    return 0


def _gpu_modes(model, repeats, P=8192, T=1024, G=16):
    """The cross-microbatch schedule on the GPU: one group in passes of 4 completions (budget P + 4T), each
    prefix_activations mode against one pass, time and peak memory."""
    groups = [bench.make_groups(1, P, T, G, vocab=151936)[0]]
    budget = P + 4 * T
    print(f"\nschedule: P={P}, T={T}, G={G}, budget {budget} tokens ({G // 4} passes); one pass = no budget")
    print(f"{'mode':>10} | {'s':>7} {'x one pass':>10} | {'peak MiB':>8} {'x one pass':>10}", flush=True)
    base = None
    for mode, mt in (("one pass", None), ("keep", budget), ("offload", budget), ("recompute", budget)):
        fn = lambda mode=mode, mt=mt: bench.shared_step(  # noqa: E731
            model,
            groups,
            max_tokens=mt,
            mode="keep" if mt is None else mode,
        )
        t, m = bench.best_time(fn, repeats), bench.cuda_peak(fn)[1]
        torch.cuda.empty_cache()
        base = base or (t, m)
        print(f"{mode:>10} | {t:>7.3f} {t / base[0]:>10.2f} | {m / MB:>8.0f} {m / base[1]:>10.3f}", flush=True)


def _speed(args):
    P, T, G = args.prompt or 2048, args.completion or 128, (args.G or [8])[0]
    model = bench.bench_model(num_hidden_layers=args.layers).to(args.device)
    groups = bench.make_groups(1, P, T, G)
    bar = _progress(3 * (args.repeats + 1) + 2, "bench")
    bar.set_description("bench: plain run")
    t_plain = bench.best_time(lambda: (model.zero_grad(), bench.plain_step(model, groups)), args.repeats, bar)
    bar.set_description("bench: sharedprefix")
    t_shared = bench.best_time(lambda: (model.zero_grad(), bench.shared_step(model, groups)), args.repeats, bar)

    def pg():
        with bench.repeated_prefix():
            model.zero_grad()
            bench.shared_step(model, groups)

    bar.set_description("bench: prompt K/V repeated per completion")
    t_pg = bench.best_time(pg, args.repeats, bar)
    fr = bench.flops(model.config, groups, False) / bench.flops(model.config, groups, True)
    fr_layers = bench.flops(model.config, groups, False, head=False) / bench.flops(
        model.config, groups, True, head=False
    )
    spec = dict(n_groups=1, prompt=P, completion=T, G=G, model=dict(num_hidden_layers=args.layers), device=args.device)
    bar.set_description("bench: peak memory of the plain run (subprocess)")
    m_plain = bench.measure_in_subprocess("plain", spec)["peak_bytes"]
    bar.update()
    bar.set_description("bench: peak memory of sharedprefix (subprocess)")
    m_shared = bench.measure_in_subprocess("keep", spec)["peak_bytes"]
    bar.update()
    bar.close()
    print(f"model: Qwen3 hidden 512, {args.layers} layers, 8/4 heads, head_dim 64, vocab 32000, float32, {args.device}")
    print(f"group: prompt {P}, G={G} completions of {T} tokens; forward+backward, best of {args.repeats}")
    print(f"plain run (SDPA rows, logits_to_keep): {t_plain:8.3f} s   peak memory +{m_plain / MB:8.1f} MiB")
    print(f"prompt K/V repeated per completion (PG): {t_pg:8.3f} s")
    print(f"sharedprefix                          : {t_shared:8.3f} s   peak memory +{m_shared / MB:8.1f} MiB")
    print(
        f"speed-up {t_plain / t_shared:.2f}x | FLOP ratio {fr:.2f}x (with LM head), {fr_layers:.2f}x (layers only)"
        f" | peak memory ratio {m_shared / max(1, m_plain):.3f}"
    )
    return 0


def _memory(args):
    P, T = args.prompt or 4096, args.completion or 256
    Gs = args.G or [4, 8, 16, 32]
    print(
        f"prompt {P}, completions {T}, budget {args.max_tokens} tokens, {args.layers} layers, {args.device}; one "
        "step (forward+backward) per configuration, each in a fresh process"
    )
    print(f"{'G':>3} {'config':<10} {'tokens':>8} {'time s':>8} {'ms/compl.tok':>12} {'peak MiB':>9}", flush=True)
    bar = _progress(len(Gs) * len(args.modes), "bench --memory")
    for G in Gs:
        spec = dict(
            n_groups=1,
            prompt=P,
            completion=T,
            G=G,
            max_tokens=args.max_tokens,
            model=dict(num_hidden_layers=args.layers),
            device=args.device,
        )
        for kind in args.modes:
            bar.set_description(f"bench --memory: G={G} {kind} (subprocess)")
            r = bench.measure_in_subprocess(kind, spec)
            per_tok = 1000 * r["time_s"] / (G * T)
            _out(
                f"{G:>3} {kind:<10} {r['tokens']:>8} {r['time_s']:>8.2f} {per_tok:>12.3f} {r['peak_bytes'] / MB:>9.1f}"
            )
            bar.update()
    bar.close()
    return 0


def _plot():
    """``--plot``: the figures of docs/benchmarks.md from the result files (``tools/plots.py``), nothing measured."""
    from sharedprefix.tools import plots

    for path in plots.draw("benchmarks", os.path.join("docs", "img")):
        print(f"wrote {path}")
    return 0
