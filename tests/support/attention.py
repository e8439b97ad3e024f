"""Explicit float64 attention (any mask, soft-capping) and the check of the cascade over a prefix tree against it."""

import torch

from helpers import tree_mask
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.layout import SegmentTree, pack_row
from sharedprefix.layout.calls import build_cascade


def qkv(seed, tq, tk, h, hkv, d, dv, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, h, d, generator=g, dtype=dtype)
    k = torch.randn(tk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(tk, hkv, dv, generator=g, dtype=dtype)
    return q, k, v


def dense_attention(q, k, v, allowed, scale, softcap=None):
    """Explicit attention with an (Tq, Tk) bool mask; float64; (out, lse) as (Tq, H, Dv), (Tq, H)."""
    n = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap is not None:  # Gemma 2: scores / cap -> tanh -> * cap, autograd differentiates it
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, vv), lse.t()


def _tree_reference(tree, qf, kf, vf, window, scale, chunk=None, blocks=()):
    """Explicit attention over every token of the tree (test only: a full mask from the tree)."""
    allowed = tree_mask(tree, window, chunk, blocks)
    return dense_attention(qf, kf, vf, allowed, scale)[0]


def check_cascade(
    impl,
    groups,
    prompt_chunk,
    row_of,
    window,
    seed=0,
    h=4,
    hkv=2,
    d=6,
    dv=6,
    repeat_prefix=False,
    chunk=None,
    blocks=(),
    drop_blocks=False,
):
    """The cascade of ``impl`` over the row of the segments ``row_of`` picks (their ancestors read as cached K/V)
    against explicit attention over the whole tree: output to 1e-12, gradients of q, k, v to 1e-10 (float64)."""
    tree = SegmentTree(groups, prompt_chunk=prompt_chunk)
    start, off = {}, 0
    for s in tree.segments:
        start[s.id] = off
        off += s.length
    qf, kf, vf = (x.requires_grad_(True) for x in qkv(seed, off, off, h, hkv, d, dv))
    want = _tree_reference(tree, qf, kf, vf, window, 0.5, chunk, blocks)
    row_segs = [s.id for s in tree.segments if row_of(s)]
    cached = {a for s in row_segs for a in tree.ancestors(s)} - set(row_segs)
    row = pack_row(tree, row_segs, cached)
    if not drop_blocks:
        row.blocks = sorted((row.row_start[s] + a, row.row_start[s] + b) for s, a, b in blocks)
    idx = torch.cat([torch.arange(start[s], start[s] + tree.segments[s].length) for s in row.segments])
    as_module = lambda x: x[idx].transpose(0, 1)[None]  # noqa: E731  (L, H, D) -> (1, H, L, D)

    def read_kv(seg):
        r = slice(start[seg], start[seg] + tree.segments[seg].length)
        return kf[r].transpose(0, 1)[None], vf[r].transpose(0, 1)[None]

    casc = build_cascade(row, window, repeat_prefix=True, chunk=chunk) if repeat_prefix else row.cascade(window, chunk)
    out = cascade_attention(impl, casc, as_module(qf), as_module(kf), as_module(vf), read_kv, 0.5)[0]
    torch.testing.assert_close(out, want[idx], rtol=0, atol=1e-12)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 1))
    got = torch.autograd.grad((out * g).sum(), (qf, kf, vf))
    ref = torch.autograd.grad((want[idx] * g).sum(), (qf, kf, vf))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    return row
