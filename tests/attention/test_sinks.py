"""Attention sinks (GPT-OSS ``s_aux``): one extra logit per head in every query's softmax denominator, merged into
the cascade's log-sum-exp, against explicit float64 attention with the sink as one more column."""

import pytest
import torch

from helpers import TREE_GROUPS, tree_mask
from sharedprefix.attention import kernels
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.layout import SegmentTree, pack_row


def _explicit(tree, q, k, v, sinks, window, scale):
    """(T, H, Dv) attention over the whole tree with a full mask and the sink as an extra, value-less logit."""
    ok = tree_mask(tree, window)
    n = q.shape[1] // k.shape[1]
    s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(n, 1)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    s = torch.cat([s, sinks[:, None, None].expand(-1, s.shape[1], 1)], -1)  # (H, T, T + 1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("hij,jhd->ihd", p, v.repeat_interleave(n, 1))


@pytest.mark.parametrize("impl", [kernels.CPU, kernels.Reference], ids=lambda c: c.name)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
@pytest.mark.parametrize("dims", [(6, 6), (12, 8)], ids=["d6", "latent_d12_dv8"])
def test_sinks_merge_exactly_into_the_cascade(impl, window, cached, dims):
    d, dv = dims
    tree = SegmentTree(TREE_GROUPS, prompt_chunk=4)
    start, off = {}, 0
    for s in tree.segments:
        start[s.id] = off
        off += s.length
    g = torch.Generator().manual_seed(0)
    q = torch.randn(off, 4, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(off, 2, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(off, 2, dv, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], dtype=torch.float64, requires_grad=True)  # large: they matter
    want = _explicit(tree, q, k, v, sinks, window, 0.5)
    in_row = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    row_segs = [s.id for s in tree.segments if in_row(s)]
    row = pack_row(tree, row_segs, {a for s in row_segs for a in tree.ancestors(s)} - set(row_segs))
    idx = torch.cat([torch.arange(start[s], start[s] + tree.segments[s].length) for s in row.segments])
    as_module = lambda x: x[idx].transpose(0, 1)[None]  # noqa: E731  (L, H, D) -> (1, H, L, D)

    def read_kv(seg):
        r = slice(start[seg], start[seg] + tree.segments[seg].length)
        return k[r].transpose(0, 1)[None], v[r].transpose(0, 1)[None]

    out = cascade_attention(impl, row.cascade(window), as_module(q), as_module(k), as_module(v), read_kv, 0.5, sinks)[0]
    torch.testing.assert_close(out, want[idx], rtol=0, atol=1e-12)
    w = torch.randn(out.shape, dtype=out.dtype, generator=g)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    ref = torch.autograd.grad((want[idx] * w).sum(), (q, k, v, sinks))
    for name, a, b in zip("q k v sinks".split(), got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_sinks_change_the_result():
    """The check above is not vacuous: without the sinks the attention differs by far more than its tolerance."""
    tree = SegmentTree(TREE_GROUPS)
    t = sum(s.length for s in tree.segments)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with_sinks = _explicit(tree, q, k, v, torch.tensor([2.0, 0.0], dtype=torch.float64), None, 0.5)
    without = _explicit(tree, q, k, v, torch.tensor([-1e9, -1e9], dtype=torch.float64), None, 0.5)
    assert (with_sinks - without).abs().max() > 0.1
