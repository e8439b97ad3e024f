"""Benchmarks: the plain run against sharedprefix, in one process, as ratios (never timed tests).

The plain run is what a careful trainer does: transformers SDPA on the G rows
``[prompt + completion_i]`` with logits only at completion positions (``logits_to_keep``).
FLOPs are counted for both layouts with the same formula (matmuls of the layers and the
head, attention pairs actually needed), so "speed-up / FLOP ratio" says how close the
implementation comes to the limit set by equal kernel efficiency.

Peak memory on CPU is the growth of the process's peak resident set (VmHWM, reset just before
the step, after the heap is trimmed) while one configuration runs in a fresh subprocess, with
glibc's mmap threshold fixed so that freed tensors leave the resident set; on CUDA it is the
caching allocator's peak over its level before the step.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import torch

import sharedprefix as sp
from sharedprefix.tools.timing import best_time, sync_device, timed  # noqa: F401  (best_time: bench.best_time)

BENCH_MODEL = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=32000,
    max_position_embeddings=16384,
)


def bench_model(dtype=torch.float32, seed=0, **overrides):
    import transformers as tf

    cfg = tf.Qwen3Config(**{**BENCH_MODEL, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.Qwen3ForCausalLM(cfg).to(dtype).eval()


def make_groups(n_groups, prompt_len, completion_len, group_size, vocab=32000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        sp.Group(
            torch.randint(0, vocab, (prompt_len,), generator=g),
            [torch.randint(0, vocab, (completion_len,), generator=g) for _ in range(group_size)],
        )
        for _ in range(n_groups)
    ]


def agentic(system=4096, prompts=8, prompt_len=512, G=8, completion=256, vocab=32000, seed=0):
    """(groups, rows, trained): the agentic shape of ``bench --tree`` (``tools.bench_tree``), a system prompt shared
    by ``prompts`` prompts, the same data as groups and as rows (completion tokens trained)."""
    g = torch.Generator().manual_seed(seed)
    sys_ids = torch.randint(0, vocab, (system,), generator=g)
    groups, rows, trained = [], [], []
    for _ in range(prompts):
        p = torch.cat([sys_ids, torch.randint(0, vocab, (prompt_len,), generator=g)])
        cs = [torch.randint(0, vocab, (completion,), generator=g) for _ in range(G)]
        groups.append(sp.Group(p, cs))
        for c in cs:
            rows.append(torch.cat([p, c]))
            trained.append(torch.arange(p.numel() + c.numel()) >= p.numel())
    return groups, rows, trained


def segment_counts(segments) -> tuple[int, int, int]:
    """(tokens, (query, key) pairs, predicted tokens) of computing ``segments``, (start, length, predicted) triples,
    each at positions start .. start + length - 1 of a causal row (a plain row is one segment from 0)."""
    tokens = sum(n for _, n, _ in segments)
    pairs = sum(((a + n) * (a + n + 1) - a * (a + 1)) // 2 for a, n, _ in segments)  # position p sees p + 1 keys
    return tokens, pairs, sum(k for _, _, k in segments)


def text_flops(cfg, tokens: float, pairs: float, predicted: float, head_dim: int | None = None) -> float:
    """Forward+backward FLOPs (3x forward) of a decoder: its linear layers per computed token, attention per
    (query, key) pair, the LM head per predicted token. ``head_dim`` for configs that do not state it."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    h, hkv, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    hd = head_dim or cfg.head_dim
    per_tok = 2 * L * (d * hd * (2 * h + 2 * hkv) + 3 * d * f)
    per_pair = 4 * L * h * hd
    return 3.0 * (tokens * per_tok + pairs * per_pair + predicted * 2 * d * V)


def flops(cfg, groups, shared: bool, head: bool = True) -> float:
    """Forward+backward FLOPs (3x forward): linear layers per token, attention per needed (query, key)
    pair, and (if ``head``) the LM head per predicted token, which both runs compute equally."""
    tokens = pairs = predicted = 0
    for g in groups:
        p = g.prompt.numel()
        for c in g.completions:
            t = c.numel()
            predicted += t
            if shared:
                tokens += t
                pairs += t * p + t * (t + 1) / 2
            else:
                tokens += p + t
                pairs += (p + t) * (p + t + 1) / 2
        if shared:
            tokens += p
            pairs += p * (p + 1) / 2
    return text_flops(cfg, tokens, pairs, predicted if head else 0)


def _rows_batch(rows):
    """Right-padded (B, L) ids and attention mask for rows that end with their completion."""
    L = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    att = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        att[i, : r.numel()] = 1
    return ids, att


def plain_rows_step(model, items):
    """items: list of (prompt, completion). Forward+backward of -sum log p, logits only where needed."""
    dev = next(model.parameters()).device
    items = [(p.to(dev), c.to(dev)) for p, c in items]
    rows = [torch.cat([p, c]) for p, c in items]
    ids, att = (x.to(dev) for x in _rows_batch(rows))
    same = all(r.numel() == ids.shape[1] for r in rows)
    T = max(c.numel() for _, c in items)
    if same and all(c.numel() == T for _, c in items):
        out = model(input_ids=ids, use_cache=False, logits_to_keep=T + 1)
        logits, tgt = out.logits[:, :-1], torch.stack([c for _, c in items])
        loss = -torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None]).sum()
    else:
        out = model(input_ids=ids, attention_mask=None if same else att, use_cache=False)
        loss = 0.0
        for i, (p, c) in enumerate(items):
            lg = out.logits[i, p.numel() - 1 : p.numel() - 1 + c.numel()]
            loss = loss - torch.log_softmax(lg.float(), -1).gather(-1, c[:, None]).sum()
    loss.backward()
    return float(loss.detach())


def plain_step(model, groups, max_tokens=None):
    """The plain run: rows [prompt + completion_i], as many whole rows per microbatch as ``max_tokens`` allows
    (all rows of a group in one batch when ``max_tokens`` is None)."""
    total = 0.0
    for g in groups:
        items = [(g.prompt, c) for c in g.completions]
        per = (
            len(items)
            if max_tokens is None
            else max(1, max_tokens // (g.prompt.numel() + max(c.numel() for c in g.completions)))
        )
        for s in range(0, len(items), per):
            total += plain_rows_step(model, items[s : s + per])
    return total


def bench_loss(b):
    return -(b.logprobs * b.mask).sum()


def in_pass_step(model, groups, max_tokens):
    """Shared-prefix attention inside one pass only (Prefix Grouper / verl style): a group larger than the
    budget is cut into sub-groups that each fit one pass, and each recomputes the prompt."""
    tokens = 0
    for g in groups:
        P, cs = g.prompt.numel(), list(g.completions)
        chunk, used = [], P
        subs = []
        for c in cs:
            if chunk and used + c.numel() > max_tokens:
                subs.append(chunk)
                chunk, used = [], P
            chunk.append(c)
            used += c.numel()
        subs.append(chunk)
        for sub in subs:
            res = sp.backward(model, [sp.Group(g.prompt, sub)], bench_loss)
            tokens += res.tokens_computed
    return tokens


def shared_step(model, groups, max_tokens=None, mode="keep"):
    return sp.backward(model, groups, bench_loss, max_tokens=max_tokens, prefix_activations=mode)


@contextlib.contextmanager
def repeated_prefix():
    """Inside: sharedprefix gathers every completion's prompt K/V into its own keys (Prefix Grouper's layout:
    one call, the prompt's K/V repeated per completion). Exact, and only a point of comparison."""
    from sharedprefix.layout.calls import build_cascade
    from sharedprefix.layout.packing import RowLayout

    own = RowLayout.cascade
    RowLayout.cascade = lambda self, window, chunk=None: build_cascade(self, window, repeat_prefix=True, chunk=chunk)
    try:
        yield
    finally:
        RowLayout.cascade = own


# Qwen3-4B's layer shapes (the anchors' model), 4 layers, bf16: the GPU benchmark's model.
GPU_MODEL = dict(
    hidden_size=2560,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    num_hidden_layers=4,
    vocab_size=151936,
    max_position_embeddings=40960,
)


def cuda_peak(fn) -> tuple[float, int]:
    """(seconds, peak bytes over the level before) of one call of ``fn`` on the current CUDA device."""
    sync_device()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    seconds = timed(fn)[0]
    return seconds, torch.cuda.max_memory_allocated() - base


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Return freed heap to the OS and reset the kernel's peak-RSS mark (VmHWM) of this process."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_in_subprocess(kind: str, spec: dict) -> dict:
    """Run one step of ``kind`` in a fresh Python process; returns time, peak memory growth and tokens."""
    code = (
        "import json,sys; from sharedprefix.tools.bench import child_run; "
        "print(json.dumps(child_run(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))"
    )
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once; with its default
    # dynamic threshold, freed tensors stay in the heap and the peak RSS measures fragmentation, not tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kind), json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child for {kind!r} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_run(kind: str, spec: dict) -> dict:
    """One measured step. Peak memory is the growth of the peak RSS over the RSS after set-up (model,
    gradient buffers, inputs); on CUDA the allocator's peak over its set-up level."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    device = torch.device(spec.get("device", "cpu"))
    model = bench_model(**spec.get("model", {})).to(device)
    # the agentic shape as rows, shared prefixes found by the trie (sharedprefix bench --tree --memory)
    if "tree" in spec:
        _, rows, trained = agentic(**spec["tree"])
        groups = sp.Tree.from_rows(rows, trained)
    else:
        groups = make_groups(spec["n_groups"], spec["prompt"], spec["completion"], spec["G"])
    for p in model.parameters():  # allocate .grad first so it is not counted as activation memory
        p.grad = torch.zeros_like(p)
    budget = spec.get("max_tokens")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    t0 = time.perf_counter()
    if kind == "plain":
        plain_step(model, groups, budget)
        tokens = sum((g.prompt.numel() + c.numel()) for g in groups for c in g.completions)
    elif kind == "in_pass":
        tokens = in_pass_step(model, groups, budget)
    else:
        tokens = shared_step(model, groups, budget, kind).tokens_computed
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()
    return {"time_s": dt, "peak_bytes": peak - base, "tokens": tokens}
