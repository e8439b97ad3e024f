"""The long-prompt regime (the schedule paper's): prompts so long that a group does not fit one pass.

``sharedprefix bench --device cuda --long``: Llama-3-8B layer shapes (hidden 4096, 32/8 heads, head_dim 128,
intermediate 14336, vocab 128256), 2 layers, bf16, forward+backward, P in {16384, 32768}, T = 1024, G in {8, 16},
one token budget for every run (default 16384: below every plain row P + T and every whole group P + G T, so that
neither fits one pass). The runs, each timed (best of ``repeats`` after a warm-up) with its allocator peak over the
level before the step:

- ``plain``: the rows [prompt, completion_i], as many whole rows per microbatch as the budget holds (at least one);
- ``in_pass``: shared-prefix attention inside a pass only (Prefix Grouper, verl, TRL's tree packing): the group is
  cut into sub-groups of as many completions as fit the budget with their prompt (at least one), and each sub-group
  recomputes the prompt;
- ``keep``, ``offload``, ``recompute``: ``sp.backward`` under the budget in each ``prefix_activations`` mode (a
  prompt longer than the budget is a chain of segments).

Then the capacity line: the longest prompt (doubling from ``start``, G = 16, T = 1024) whose step trains without
running out of device memory, for the plain rows (one row per microbatch: one row is run, as every microbatch is
the same), in-pass sharing (one group per pass) and ours (the budget, ``recompute``, long prompts as chains),
searched up to ``limit`` tokens (131072 by default: with 8 layers the plain row runs out below it on an H200).

On the CPU the same code runs with tiny shapes (``TINY_MODEL``, the options of ``run`` and ``capacity``), so that
a test keeps it from rotting; nothing runs out of memory there and peaks are not measured ("-").

Notation: P = prompt length, T = completion length, G = group size.
"""

from __future__ import annotations

import math

import torch

from sharedprefix.tools import bench
from sharedprefix.tools.timing import timed

LONG_MODEL = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    num_hidden_layers=2,
    max_position_embeddings=1 << 20,
    rope_theta=500000.0,
)
TINY_MODEL = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=128,
    num_hidden_layers=2,
    max_position_embeddings=4096,
)
RUNS = ("plain", "in_pass", "keep", "offload", "recompute")
MB = 2**20


def long_model(device, dtype=torch.bfloat16, **overrides):
    """A Llama model of LONG_MODEL's shapes (or ``overrides``), random weights, on ``device``, .grad allocated."""
    import transformers as tf

    cfg = tf.LlamaConfig(**{**LONG_MODEL, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(dtype).to(device).eval()
    for p in model.parameters():  # allocated first, so that they count as the level, not as the step's peak
        p.grad = torch.zeros_like(p)
    return model


def step(kind: str, model, groups, budget: int):
    """One forward+backward of ``kind`` (RUNS) over ``groups`` under ``budget`` tokens."""
    if kind == "plain":
        return bench.plain_step(model, groups, budget)
    if kind == "in_pass":
        return bench.in_pass_step(model, groups, budget)
    return bench.shared_step(model, groups, budget, kind)


def _measure(fn, device, repeats: int) -> tuple[float, float]:
    """(best seconds of ``repeats`` calls after a warm-up, allocator peak over the level before them; NaN on the CPU)
    of ``fn``; (NaN, NaN) when it runs out of device memory."""
    cuda = device.type == "cuda"
    try:
        fn()  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = min(timed(fn)[0] for _ in range(repeats))
        peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    except torch.OutOfMemoryError:
        t = peak = float("nan")
    if cuda:
        torch.cuda.empty_cache()
    return t, peak


def run(
    device, shapes=None, budget: int = 16384, repeats: int = 1, report=print, model_kw=None, dtype=torch.bfloat16
) -> dict:
    """The long-prompt table; returns {(P, T, G): {run: (seconds, peak bytes)}}. ``shapes``: (P, T, G) triples
    (default the issue's grid); ``model_kw``: overrides of LONG_MODEL (the CPU test passes TINY_MODEL)."""
    device = torch.device(device)
    shapes = shapes or [(P, 1024, G) for P in (16384, 32768) for G in (8, 16)]
    model = long_model(device, dtype, **(model_kw or {}))
    cfg = model.config
    report(
        f"long prompts: Llama layer shapes (hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} "
        f"heads, head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}), "
        f"{cfg.num_hidden_layers} layers, {dtype}, {device}; forward+backward, best of {repeats}; budget {budget} "
        "tokens for every run; peak = allocator peak over the level before the step"
    )
    report(f"{'P':>6} {'T':>5} {'G':>3} {'run':<10} {'s':>8} {'peak MiB':>9} {'x keep':>7}")
    out = {}
    for P, T, G in shapes:
        groups = bench.make_groups(1, P, T, G, vocab=cfg.vocab_size)
        res = {
            kind: _measure(lambda kind=kind, groups=groups: step(kind, model, groups, budget), device, repeats)
            for kind in RUNS
        }
        for kind, (t, m) in res.items():
            peak = "-" if math.isnan(m) else f"{m / MB:.0f}"
            report(f"{P:>6} {T:>5} {G:>3} {kind:<10} {t:>8.3f} {peak:>9} {t / res['keep'][0]:>6.2f}x")
        out[P, T, G] = res
    return out


def longest(fits, start: int, limit: int) -> int:
    """The largest P = start * 2**k <= limit with ``fits(P)`` true for it and every smaller one (0 if none)."""
    best, P = 0, start
    while P <= limit and fits(P):
        best, P = P, 2 * P
    return best


def capacity(device, start: int = 16384, T: int = 1024, G: int = 16, limit: int = 131072, budget: int = 16384,
             report=print, model_kw=None, dtype=torch.bfloat16) -> dict:  # fmt: skip
    """The capacity line: {run: longest prompt that trains} for plain rows (one per microbatch), in-pass sharing (one
    group per pass) and ours (``recompute`` under ``budget``). ``model_kw`` overrides LONG_MODEL."""
    device = torch.device(device)
    model = long_model(device, dtype, **(model_kw or {}))
    runs = {  # run -> (step, completions per group)
        "plain": (lambda groups: bench.plain_step(model, groups, 1), 1),
        "in_pass": (lambda groups: bench.shared_step(model, groups), G),
        "ours": (lambda groups: bench.shared_step(model, groups, budget, "recompute"), G),
    }

    def fits(run, P) -> bool:
        fn, n = run
        groups = bench.make_groups(1, P, T, n, vocab=model.config.vocab_size)
        try:
            fn(groups)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return ok

    best = {kind: longest(lambda P, run=run: fits(run, P), start, limit) for kind, run in runs.items()}
    ends = {k: " (the search's limit)" if v * 2 > limit else "" for k, v in best.items()}
    report(
        f"capacity (longest prompt that trains; G={G}, T={T}, {model.config.num_hidden_layers} layers, doubling from "
        f"{start} up to {limit}): plain {best['plain']}{ends['plain']} | in_pass {best['in_pass']}{ends['in_pass']} | "
        f"ours {best['ours']}{ends['ours']}"
    )
    return best
