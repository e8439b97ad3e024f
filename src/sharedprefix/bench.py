"""Benchmarks: the plain run against sharedprefix, in one process, as ratios (never timed tests).

The plain run is what a careful trainer does: transformers SDPA on the G rows
``[prompt + completion_i]`` with logits only at completion positions (``logits_to_keep``).
FLOPs are counted for both layouts with the same formula (matmuls of the layers and the
head, attention pairs actually needed), so "speed-up / FLOP ratio" says how close the
implementation comes to the limit set by equal kernel efficiency.

Peak memory on CPU is read as the growth of the process's peak resident set while one
configuration runs in a fresh subprocess; on CUDA from the caching allocator.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch

import sharedprefix as sp

BENCH_MODEL = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    intermediate_size=1536, vocab_size=32000, max_position_embeddings=16384,
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
        sp.Group(torch.randint(0, vocab, (prompt_len,), generator=g),
                 [torch.randint(0, vocab, (completion_len,), generator=g) for _ in range(group_size)])
        for _ in range(n_groups)
    ]


def flops(cfg, groups, shared: bool) -> float:
    """Forward FLOPs (x3 for forward+backward): linear layers per token, attention per needed pair, head per predicted token."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd, h, hkv, V = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    per_tok = 2 * L * (d * hd * (2 * h + 2 * hkv) + 3 * d * f)
    per_pair = 4 * L * h * hd
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
    return 3.0 * (tokens * per_tok + pairs * per_pair + predicted * 2 * d * V)


def plain_step(model, groups, loss_scale=1.0):
    """Forward+backward of the plain run: one padded batch of G rows per group, logits only where needed."""
    total = 0.0
    for g in groups:
        rows = [torch.cat([g.prompt, c]) for c in g.completions]
        T = max(c.numel() for c in g.completions)
        L = max(r.numel() for r in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        att = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):  # right padding; completions at the end of each row
            ids[i, : r.numel()] = r
            att[i, : r.numel()] = 1
        same = all(r.numel() == L for r in rows)
        out = model(input_ids=ids, attention_mask=None if same else att, use_cache=False,
                    logits_to_keep=T + 1 if same else 0)
        logits = out.logits[:, -(T + 1) : -1] if same else out.logits
        logp = torch.log_softmax(logits.float(), -1)
        tgt = torch.stack([c for c in g.completions]) if same else None
        loss = -logp.gather(-1, tgt[..., None]).sum() * loss_scale
        loss.backward()
        total += float(loss)
    return total


def shared_step(model, groups, max_tokens=None, mode="keep"):
    return sp.backward(model, groups, lambda b: -(b.logprobs * b.mask).sum(), max_tokens=max_tokens,
                       prefix_activations=mode)


def _time(fn, repeats):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_peak(kind: str, spec: dict) -> int:
    """Peak memory growth (bytes) of one step of ``kind`` in a fresh subprocess."""
    code = (
        "import json,sys; from sharedprefix.bench import _peak_child; "
        f"print(json.dumps(_peak_child({kind!r}, json.loads(sys.argv[1]))))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def _peak_child(kind: str, spec: dict) -> int:
    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    model = bench_model(**spec.get("model", {}))
    groups = make_groups(spec["n_groups"], spec["prompt"], spec["completion"], spec["G"])
    model.zero_grad()
    for p in model.parameters():  # allocate .grad first so it is not counted as activation memory
        p.grad = torch.zeros_like(p)
    base = max(_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if kind == "plain":
        plain_step(model, groups)
    else:
        shared_step(model, groups, spec.get("max_tokens"), kind)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak - base
