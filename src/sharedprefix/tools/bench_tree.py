"""The agentic benchmark (``sharedprefix bench --tree``): a system prompt shared by many prompts.

Shape: a 4096-token system prompt (tool schemas) shared by 8 prompts of 512 tokens each, G = 8
completions of 256 per prompt, forward+backward under one token budget. Three runs, measured in
one process: per-group sharing (each group's prompt, system prompt included, once per group:
today's ``list[Group]`` behaviour and what Prefix Grouper / verl share), the tree (``Tree.from_rows``:
the system prompt once for all), and, with ``--plain``, the plain run (one row per completion;
slow on CPU, so off by default: its token count is reported either way).

FLOPs are counted per segment tree with one formula: linear layers per computed token, attention
per (query, key) pair actually needed, the LM head per predicted token.
"""

from __future__ import annotations

import sharedprefix as sp
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.tools import bench
from sharedprefix.tools.bench import agentic
from sharedprefix.tools.timing import best_interleaved, timed


def tree_flops(cfg, tree: SegmentTree) -> float:
    """Forward+backward FLOPs (3x forward) of computing ``tree``: every segment once."""
    return bench.text_flops(cfg, *bench.segment_counts([(s.start, s.length, s.n_computed) for s in tree.segments]))


def _loss(b):
    return -(b.logprobs * b.mask).sum()


def run(max_tokens=8192, layers=4, plain=False, device="cpu", **shape) -> list[str]:
    model = bench.bench_model(num_hidden_layers=layers).to(device)
    groups, rows, trained = agentic(**shape)
    tree = sp.Tree.from_rows(rows, trained)
    p_groups, p_tree = sp.plan(groups, max_tokens), sp.plan(tree, max_tokens)
    plain_tokens = sum(r.numel() for r in rows)
    out = [
        f"agentic shape {shape or 'default'}: system 4096 shared by 8 prompts of 512, G=8 x 256; budget "
        f"{max_tokens}; Qwen3 hidden 512, {layers} layers, vocab 32000, float32, {device}; after a warm-up, "
        "best of 2 runs each in the order tree, per-group, per-group, tree"
    ]
    small_g, small_rows, small_t = agentic(system=64, prompts=2, prompt_len=16, G=2, completion=8)
    for src in (small_g, sp.Tree.from_rows(small_rows, small_t)):  # warm-up: first-call costs out of the timings
        sp.backward(model, src, _loss, max_tokens=max_tokens)

    def run(src):
        return lambda: sp.backward(model, src, _loss, max_tokens=max_tokens)

    order = [("tree", run(tree)), ("per-group", run(groups)), ("per-group", run(groups)), ("tree", run(tree))]
    best = best_interleaved(order, before=lambda: model.zero_grad(set_to_none=True))
    res = {name: (t, r.tokens_computed, r.passes) for name, (t, r) in best.items()}
    if plain:
        res["plain"] = (timed(lambda: bench.plain_step(model, groups, max_tokens))[0], plain_tokens, None)
    fl = {"per-group": tree_flops(model.config, p_groups.tree), "tree": tree_flops(model.config, p_tree.tree)}
    for name, (t, tok, passes) in res.items():
        out.append(f"{name:<10} {t:8.2f} s  tokens computed {tok:>7}  passes {passes}")
    out.append(f"plain run would compute {plain_tokens} tokens")
    sp_ratio = res["per-group"][0] / res["tree"][0]
    fr = fl["per-group"] / fl["tree"]
    out.append(
        f"tree vs per-group: speed-up {sp_ratio:.2f}x, FLOP ratio {fr:.2f}x ({sp_ratio / fr:.2f} of it); "
        f"tokens {res['per-group'][1] / res['tree'][1]:.2f}x fewer"
    )
    return out


def memory(
    max_tokens=8192,
    layers=2,
    prompts=(2, 4, 8, 16),
    modes=("keep", "recompute"),
    device="cpu",
    G=4,
    completion=128,
    report=print,
) -> list[str]:
    """Peak memory against the number of prompts sharing the 4096-token system prompt, under one budget.

    One fresh process per (prompts, mode), as ``sharedprefix bench --memory``: the peak is the growth of the
    peak RSS (CPU) or of the allocator's peak (CUDA) over the level after set-up. ``report`` gets each line
    as its run finishes.
    """
    head = (
        f"agentic shape: system 4096 shared by n prompts of 512, G={G} x {completion}; budget {max_tokens}; "
        f"Qwen3 hidden 512, {layers} layers, float32, {device}; one fresh process per row"
    )
    lines = [head, f"{'prompts':>7} {'mode':>9} {'tokens':>7} {'passes':>6} {'time s':>7} {'peak MiB':>9}"]
    for line in lines:
        report(line)
    for n in prompts:
        shape = dict(prompts=n, G=G, completion=completion)
        passes = len(sp.plan(sp.Tree.from_rows(*agentic(**shape)[1:]), max_tokens).passes)
        for mode in modes:
            spec = dict(tree=shape, max_tokens=max_tokens, model=dict(num_hidden_layers=layers), device=device)
            r = bench.measure_in_subprocess(mode, spec)
            lines.append(
                f"{n:>7} {mode:>9} {r['tokens']:>7} {passes:>6} {r['time_s']:>7.2f} {r['peak_bytes'] / 2**20:>9.1f}"
            )
            report(lines[-1])
    return lines
