"""The hybrid benchmark (``sharedprefix bench --hybrid``): a model whose layers mix tokens outside attention.

Shape: the speed benchmark's group (prompt 2048, G = 8 completions of 128) on a Qwen3.5-style architecture (hidden
512, gated delta-net and attention layers 3:1, 8/4 attention heads of 64, delta-net 4 key / 8 value heads of 64,
vocab 32000), random weights, float32, forward+backward. Three runs in the same process:

- plain: the G rows ``[prompt + completion_i]`` in one batch, logits at completion positions only;
- packed: ``sp.backward``, the packed path (``model.mixers``): the prompt once, every completion in the same row,
  each from the prompt's final conv inputs and recurrent state;
- cache path: ``schedule.cache_path.run.backward`` (the path these models took before, still the one of MiniMax
  and Zaya): the prompt once through the model's own cache-aware forward, the completions as right-padded rows
  from copies of its cache.

Reported against the token ratio (tokens a plain run computes / tokens sharedprefix computes), the ratio a run bound
by its per-token layers would reach.

``sharedprefix bench --hybrid --tree`` (``tree``): the same model on the agentic shape of ``bench --tree`` (a
4096-token system prompt shared by 8 prompts of 512, G = 8 completions of 256 each), forward+backward under one token
budget (8192 by default), after a warm-up on a small shape:

- packed tree: ``sp.backward`` on ``sp.Tree.from_rows`` of the 64 rows: the system prompt once for all, each prompt
  once, every scan from its parent segment's final state (read from the prefix cache across passes);
- cache path: ``schedule.cache_path.run.backward`` on the 8 groups: it takes no trees, so it computes each group's
  prompt, the system prompt included, once per group;
- plain rows: ``[prompt + completion_i]``, as many whole rows per microbatch as the budget holds (one: 4864 tokens).
  Every microbatch has the same shape, so by default ``plain_sample`` of them (spread over the groups) are timed and
  the sum is scaled to all of them (the line says so); ``plain_sample=None`` (``--plain``) times every one.

Reported: seconds, tokens computed and passes of each, the speed-ups, and the packed tree's speed-up over plain rows
against the ratio of tokens computed (the target: at least 0.9 of it) and against an estimated FLOP ratio
(``hybrid_flops``: the layers' parameters per token, attention per (query, key) pair, the LM head per predicted token;
the scans are not counted, so it is no bound), with that FLOP ratio over the token ratio for this model and for
transformers' default Qwen3.5 dimensions (``flops_vs_tokens``, on the meta device). ``dims="qwen3.5"``
(``--dims qwen3.5``) builds the model itself at those dimensions; on CUDA it runs in bfloat16, timed in wall seconds
(``scripts/dev gpu-check`` runs it at 16 layers and reads the figures with ``tree_figures``).
"""

from __future__ import annotations

import torch

from sharedprefix.tools import bench
from sharedprefix.tools.timing import best_interleaved, cpu_clock

BENCH_DIMS = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=1536,
    vocab_size=32000,
)
DIMS = {"bench": BENCH_DIMS, "qwen3.5": {}}  # "qwen3.5": transformers' own Qwen3_5TextConfig defaults (hidden 4096)


def hybrid_config(layers=4, dims="bench"):
    """A Qwen3.5 text config with ``layers`` decoder layers, delta-net and attention 3:1, of the benchmark's tiny
    dimensions (``"bench"``) or of transformers' default Qwen3.5 dimensions (``"qwen3.5"``: hidden 4096,
    16/4 heads of 256, delta-net 16/32 heads of 128, intermediate 12288, vocab 248320)."""
    import transformers as tf

    if dims not in DIMS:
        raise ValueError(f"dims={dims!r}: expected one of {sorted(DIMS)}")
    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) + ["linear_attention"] * (layers % 4)
    cfg = tf.Qwen3_5TextConfig(**DIMS[dims], num_hidden_layers=layers, max_position_embeddings=16384, layer_types=types)
    cfg._attn_implementation = "sdpa"
    return cfg


def hybrid_model(layers=4, dtype=torch.float32, seed=0, dims="bench", device="cpu"):
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(device):
        return tf.Qwen3_5ForCausalLM(hybrid_config(layers, dims)).to(dtype).eval()


def describe(cfg) -> str:
    return (
        f"Qwen3.5-style, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({', '.join(cfg.layer_types)}), "
        f"vocab {cfg.vocab_size}"
    )


def cache_path_step(model, groups, max_tokens=None):
    """The cache-driven path these families took before the packed one (``schedule.cache_path``)."""
    from sharedprefix.schedule.cache_path import run as cache_run
    from sharedprefix.schedule.options import CallOptions

    return cache_run.backward(model, groups, bench.bench_loss, CallOptions.build(max_tokens=max_tokens))


def run(layers=4, repeats=2, prompt=2048, completion=128, G=8) -> list[str]:
    model = hybrid_model(layers)
    groups = bench.make_groups(1, prompt, completion, G)

    def step(fn):
        return lambda: (model.zero_grad(set_to_none=True), fn(model, groups))

    t_plain = bench.best_time(step(bench.plain_step), repeats)  # each after one warm-up call
    t_ours = bench.best_time(step(bench.shared_step), repeats)
    t_cache = bench.best_time(step(cache_path_step), repeats)
    plain_tokens, ours_tokens = G * (prompt + completion), prompt + G * completion
    return [
        f"model: {describe(model.config)}, float32, cpu",
        f"group: prompt {prompt}, G={G} completions of {completion} tokens; forward+backward, best of {repeats}",
        f"plain run (rows in one batch, logits_to_keep): {t_plain:8.3f} s   tokens {plain_tokens}",
        f"sharedprefix, packed path                   : {t_ours:8.3f} s   tokens {ours_tokens}",
        f"old cache path (schedule.hybrid)            : {t_cache:8.3f} s   tokens {ours_tokens} (completions padded)",
        f"speed-up over plain {t_plain / t_ours:.2f}x | over the cache path {t_cache / t_ours:.2f}x | "
        f"token ratio {plain_tokens / ours_tokens:.2f}x | packed / token ratio "
        f"{(t_plain / t_ours) / (plain_tokens / ours_tokens):.2f}",
    ]


def hybrid_flops(model, segments) -> float:
    """Forward+backward FLOPs (3x forward) of computing ``segments`` ((start, length, predicted) triples; a plain row
    is one segment from 0): the decoder layers' parameters per computed token, attention per (query, key) pair on the
    attention layers only, the LM head per predicted token. The delta rule's own scan (a state update per token and
    head, O(Dk * Dv)) is not counted: an estimate, for the ratio between layouts."""
    cfg = model.config
    per_tok = 2 * sum(p.numel() for p in model.model.layers.parameters())
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    per_pair = 4 * attn * cfg.num_attention_heads * cfg.head_dim
    tokens, pairs, predicted = bench.segment_counts(segments)
    return 3.0 * (tokens * per_tok + pairs * per_pair + predicted * 2 * cfg.hidden_size * cfg.vocab_size)


_FIGURES = {
    "vs_tokens": r"speed-up / token ratio (nan|inf|[0-9.]+) ",
    "vs_flops": r"speed-up / FLOP ratio (nan|inf|[0-9.]+)$",
    "flops_vs_tokens": r"FLOP ratio / token ratio: (nan|inf|[0-9.]+) for this model",
}


def tree_figures(lines) -> dict:
    """{"vs_tokens", "vs_flops", "flops_vs_tokens"}, those found in ``tree``'s lines
    (what ``scripts/dev gpu-check`` reads)."""
    import re

    return {k: float(m.group(1)) for line in lines for k, pat in _FIGURES.items() if (m := re.search(pat, line))}


def flops_vs_tokens(cfg, tree_segments, plain_segments) -> float:
    """The estimated FLOP ratio plain / tree of a model of config ``cfg`` (built on the meta device: no weights) over
    the ratio of tokens computed: what a run whose time follows the estimate's FLOPs reaches of the token ratio (the
    delta rule's scans, which scale with the tokens and run at a lower rate than matrix products, are not counted,
    so a measured run can exceed it)."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(cfg)
    tokens = sum(n for _, n, _ in plain_segments) / sum(n for _, n, _ in tree_segments)
    return hybrid_flops(model, plain_segments) / hybrid_flops(model, tree_segments) / tokens


def tree(
    layers=4, repeats=1, max_tokens=8192, plain_sample: int | None = 4, device="cpu", dims="bench", **shape
) -> list[str]:
    """The agentic tree shape on the hybrid (see the module docstring); ``shape`` overrides ``bench.agentic``'s.
    On CUDA the model is bfloat16 and the times are wall seconds between synchronisations."""
    import inspect
    import time

    import sharedprefix as sp
    from sharedprefix.tools.bench import agentic

    cuda = str(device).startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = hybrid_model(layers, dtype, dims=dims, device=device)
    d = {k: v.default for k, v in inspect.signature(agentic).parameters.items()} | shape
    groups, rows, trained = agentic(**shape)
    tree_src = sp.Tree.from_rows(rows, trained)
    small_g, small_rows, small_t = agentic(system=64, prompts=2, prompt_len=16, G=2, completion=8)

    def packed(src):
        return sp.backward(model, src, bench.bench_loss, max_tokens=max_tokens)

    def cache(gs):
        return cache_path_step(model, gs, max_tokens)

    items = [(g.prompt, c) for g in groups for c in g.completions]
    per = max(1, max_tokens // max(p.numel() + c.numel() for p, c in items))
    batches = [items[i : i + per] for i in range(0, len(items), per)]
    timed = batches if plain_sample is None else batches[:: max(1, len(batches) // plain_sample)][:plain_sample]
    for fn, src in ((packed, sp.Tree.from_rows(small_rows, small_t)), (cache, small_g)):  # warm-ups
        fn(src)
    bench.plain_rows_step(model, [(small_g[0].prompt, small_g[0].completions[0])])

    clock = cpu_clock(cuda)

    def timed_call(fn):
        best = best_interleaved([("", fn)] * repeats, before=lambda: model.zero_grad(set_to_none=True), clock=clock)
        return best[""]

    t_tree, r_tree = timed_call(lambda: packed(tree_src))
    t_cache, r_cache = timed_call(lambda: cache(groups))
    t_some, _ = timed_call(lambda: [bench.plain_rows_step(model, b) for b in timed])
    t_plain = t_some * len(batches) / len(timed)
    plain_tokens = sum(r.numel() for r in rows)
    rows_len = items[0][0].numel() + items[0][1].numel()
    how = (
        "all timed"
        if len(timed) == len(batches)
        else f"{len(timed)} timed, the sum scaled by {len(batches) / len(timed):g}"
    )
    token_ratio = plain_tokens / r_tree.tokens_computed
    planned = sp.plan(tree_src, max_tokens).tree.segments
    seg_tree = [(s.start, s.length, s.n_computed) for s in planned]
    seg_plain = [(0, p.numel() + c.numel(), c.numel()) for p, c in items]
    fl_ratio = hybrid_flops(model, seg_plain) / hybrid_flops(model, seg_tree)
    full = hybrid_config(32, "qwen3.5")
    speedup = t_plain / t_tree
    where = f"{'bfloat16' if cuda else 'float32'}, {torch.cuda.get_device_name() if cuda else 'cpu'}"
    return [
        f"model: {describe(model.config)}, {where}",
        f"agentic shape: system {d['system']} shared by {d['prompts']} prompts of {d['prompt_len']}, G={d['G']} x "
        f"{d['completion']} ({len(rows)} rows of {rows_len}); budget {max_tokens}; forward+backward after a warm-up, "
        f"best of {repeats}; "
        f"{'CPU seconds of the process (one thread)' if clock is time.process_time else 'wall seconds'}",
        f"packed tree (sp.Tree)         : {t_tree:8.2f} s   tokens computed {r_tree.tokens_computed:>7}  passes "
        f"{r_tree.passes}",
        f"cache path (groups; no trees) : {t_cache:8.2f} s   tokens computed {r_cache.tokens_computed:>7}  passes "
        f"{r_cache.passes}",
        f"plain rows                    : {t_plain:8.2f} s   tokens computed {plain_tokens:>7}  microbatches "
        f"{len(batches)} of {per} row(s) ({how})",
        f"packed tree over plain rows {speedup:.2f}x | ratio of tokens computed {token_ratio:.2f}x | "
        f"speed-up / token ratio {speedup / token_ratio:.2f} (target >= 0.9)",
        f"FLOP ratio plain / tree {fl_ratio:.2f}x (estimate: layers per token, attention per pair on the "
        "attention layers, LM head per predicted token; scans not counted) | speed-up / FLOP ratio "
        f"{speedup / fl_ratio:.2f}",
        f"FLOP ratio / token ratio: {fl_ratio / token_ratio:.3f} for this model (its LM head and attention do not "
        f"shrink with the tokens; scans not counted); {flops_vs_tokens(full, seg_tree, seg_plain):.3f} at "
        f"transformers' default Qwen3.5 dimensions ({describe(full).split(' (')[0]}, vocab {full.vocab_size}; no "
        "weights built)",
        f"packed tree over the cache path {t_cache / t_tree:.2f}x | its tokens "
        f"{r_cache.tokens_computed / r_tree.tokens_computed:.2f}x "
        "fewer (the cache path repeats the system prompt per group)",
    ]
