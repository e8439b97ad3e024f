"""The attention primitive and the cascade over the tree, against explicit float64 attention."""

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import TREE_GROUPS, tree_mask
from sharedprefix.attention import kernels
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.layout import SegmentTree, pack_row
from sharedprefix.layout.cascade import build_cascade

IMPLS = [kernels.CPU, kernels.Reference]


def _qkv(seed, tq, tk, h, hkv, d, dv, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, h, d, generator=g, dtype=dtype)
    k = torch.randn(tk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(tk, hkv, dv, generator=g, dtype=dtype)
    return q, k, v


def _dense(q, k, v, allowed, scale, softcap=None):
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


def _entry_mask(lq_list, lk_list, causal, window):
    """The contract's mask for a whole varlen call (test only): block diagonal, bottom-right aligned."""
    tq, tk = sum(lq_list), sum(lk_list)
    m = torch.zeros(tq, tk, dtype=torch.bool)
    a = b = 0
    for lq, lk in zip(lq_list, lk_list):
        i = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None]
        ok = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            ok &= j <= i
        if window is not None:
            ok &= j >= i - window
        m[a : a + lq, b : b + lk] = ok
        a, b = a + lq, b + lk
    return m


def _cu(xs):
    return torch.tensor([0] + list(torch.tensor(xs).cumsum(0).tolist()), dtype=torch.int32)


CASES = {
    # name: (query lengths, key lengths, causal, window)
    "causal_square": ([5, 1, 300, 7], [5, 1, 300, 7], True, None),
    "dense": ([4, 0, 9], [6, 3, 2], False, None),
    "causal_window": ([300, 1, 12], [300, 1, 12], True, 3),
    "window_zero": ([1, 4], [2, 4], True, 0),
    "causal_rect": ([3, 2], [8, 2], True, None),
    "dense_window": ([6, 5], [10, 3], False, 4),
}


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dims", [(8, 8), (8, 12), (12, 6)], ids=["d", "dv_larger", "dv_smaller"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_primitive_forward_and_backward_match_explicit_attention(impl, heads, dims, case):
    lq, lk, causal, window = CASES[case]
    h, hkv = heads
    d, dv = dims
    q, k, v = _qkv(0, sum(lq), sum(lk), h, hkv, d, dv)
    allowed = _entry_mask(lq, lk, causal, window)
    scale = 0.37
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    want, want_lse = _dense(q_, k_, v_, allowed, scale)
    out, lse = impl.forward(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, scale)
    assert out.shape == want.shape and lse.shape == want_lse.shape and lse.dtype == torch.float64
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=0, atol=1e-12)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    want.backward(g)
    dq, dk, dvv = impl.backward(g, q, k, v, out, lse, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, scale)
    for got, ref in ((dq, q_.grad), (dk, k_.grad), (dvv, v_.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("dims", [(8, 8), (12, 6)], ids=["d", "dv_smaller"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_softcapped_primitive_matches_explicit_attention(impl, dims, case, monkeypatch):
    """Soft-capped scores (Gemma 2): tiles of 4 queries and blocks of 3 keys, so that the CPU path merges blocks."""
    monkeypatch.setattr(kernels.cpu, "TILE", 4)
    monkeypatch.setattr(kernels.cpu, "KEY_BLOCK", 3)
    lq, lk, causal, window = CASES[case]
    q, k, v = _qkv(2, sum(lq), sum(lk), 4, 2, *dims)
    q = q * 4  # scores of several units, where tanh(s / 1.5) caps visibly
    allowed = _entry_mask(lq, lk, causal, window)
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    want, want_lse = _dense(q_, k_, v_, allowed, 0.37, softcap=1.5)
    plain, _ = _dense(q, k, v, allowed, 0.37)
    if case != "window_zero":  # (one key per query there: any scores give the same output)
        assert (plain - want).abs().max() > 1e-2  # the cap changes the result: the comparison below can fail
    out, lse = impl.forward(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, 0.37, softcap=1.5)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=0, atol=1e-12)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    want.backward(g)
    grads = impl.backward(g, q, k, v, out, lse, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, 0.37, softcap=1.5)
    for got, ref in zip(grads, (q_.grad, k_.grad, v_.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_softcapped_cpu_primitive_in_float32_and_bfloat16_stays_near_float64():
    lq = lk = [40, 3, 17]
    q, k, v = _qkv(3, 60, 60, 4, 2, 16, 16)
    want, want_lse = kernels.Reference.forward(q, k, v, _cu(lq), _cu(lk), 40, 40, True, None, 0.25, softcap=2.0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out, lse = kernels.CPU.forward(q.to(dtype), k.to(dtype), v.to(dtype), _cu(lq), _cu(lk), 40, 40, True, None, 0.25, softcap=2.0)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() < tol and (lse.double() - want_lse).abs().max() < tol


def test_cpu_primitive_in_float32_and_bfloat16_stays_near_float64():
    lq = lk = [40, 3, 17]
    q, k, v = _qkv(3, 60, 60, 4, 2, 16, 16)
    want, want_lse = kernels.Reference.forward(q, k, v, _cu(lq), _cu(lk), 40, 40, True, None, 0.25)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out, lse = kernels.CPU.forward(q.to(dtype), k.to(dtype), v.to(dtype), _cu(lq), _cu(lk), 40, 40, True, None, 0.25)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() < tol and (lse.double() - want_lse).abs().max() < tol


def _tree_reference(tree, qf, kf, vf, window, scale, chunk=None, blocks=()):
    """Explicit attention over every token of the tree (test only: a full mask from the tree)."""
    allowed = tree_mask(tree, window, chunk, blocks)
    return _dense(qf, kf, vf, allowed, scale)[0]


def _check_cascade(
    impl, groups, prompt_chunk, row_of, window, seed=0, h=4, hkv=2, d=6, dv=6, repeat_prefix=False, chunk=None, blocks=(), drop_blocks=False
):
    tree = SegmentTree(groups, prompt_chunk=prompt_chunk)
    start, off = {}, 0
    for s in tree.segments:
        start[s.id] = off
        off += s.length
    qf, kf, vf = (x.requires_grad_(True) for x in _qkv(seed, off, off, h, hkv, d, dv))
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


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("window", [None, 1, 2, 5, 12, 100])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_cascade_equals_explicit_tree_attention(impl, window, prompt_chunk, cached):
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    _check_cascade(impl, TREE_GROUPS, prompt_chunk, row_of, window)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_chunked_cascade_equals_explicit_tree_attention(impl, chunk, prompt_chunk, cached):
    """Chunks of positions (Llama 4): a completion continues its prompt's chunk, whose keys may lie in the prompt."""
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    _check_cascade(impl, TREE_GROUPS, prompt_chunk, row_of, None, chunk=chunk)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("window", [None, 1, 2, 3, 6, 100])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_bidirectional_blocks_equal_explicit_attention(impl, window, cached):
    """Gemma 3's image tokens: each block also sees its own later keys, AND(window, OR(causal, block)); blocks
    longer than the window, of one token, touching, at a prompt's start and end, in several prompts of the row."""
    groups = [sp.Group(list(range(1, 11)), [[1, 2, 3], [4], [5, 6]]), sp.Group([7, 8, 9, 10, 11], [[1, 2]]), sp.Group([3, 4, 5, 6], [[7]])]
    tree = SegmentTree(groups)
    roots = [s.id for s in tree.segments if s.parent is None]
    blocks = [(roots[0], 0, 3), (roots[0], 3, 4), (roots[0], 4, 5), (roots[0], 6, 10), (roots[1], 1, 4), (roots[2], 0, 4)]
    row_of = (lambda s: s.completion is not None or s.group != 1) if cached else (lambda s: True)
    in_row = [b for b in blocks if row_of(tree.segments[b[0]])]
    _check_cascade(impl, groups, None, row_of, window, blocks=in_row)


def test_blocks_fail_the_cascade_test_without_their_call():
    """The reference sees the blocks: a cascade that ignored them would not match it."""
    groups = [sp.Group(list(range(1, 7)), [[1, 2]])]
    root = SegmentTree(groups).segments[0].id
    with pytest.raises(AssertionError):
        _check_cascade(kernels.Reference, groups, None, lambda s: True, None, blocks=[(root, 1, 4)], drop_blocks=True)


def test_chunked_cascade_pieces():
    tree = SegmentTree([sp.Group(list(range(1, 7)), [[1, 2, 3], [4]])])  # prompt at 0..5, completions at 6..8, 6
    row = pack_row(tree, [0, 1, 2], cached=set())
    no_bite = row.cascade(None, 9)  # every position (0..8) in chunk 0: the plain cascade
    assert len(no_bite.calls) == 2 and no_bite.copied_keys == 0
    (call,) = row.cascade(None, 4).calls
    assert call.causal and call.window is None
    # prompt: chunks 0..3 and 4..5; completion 1: positions 6, 7 (chunk 4..7: prompt keys 4, 5) and 8 (chunk 8..);
    # completion 2: position 6 (prompt keys 4, 5)
    assert call.cu_seqlens_q.tolist() == [0, 4, 6, 8, 9, 10]
    assert call.k_index.tolist() == [0, 1, 2, 3] + [4, 5] + [4, 5, 6, 7] + [8] + [4, 5, 9]
    assert call.cu_seqlens_k.tolist() == [0, 4, 6, 10, 11, 14]


@pytest.mark.parametrize("window", [None, 3])
def test_repeated_prefix_comparison_layout_is_exact_too(window):
    """The benchmark's Prefix-Grouper-style layout (prefix K/V gathered per completion) computes the same."""
    _check_cascade(kernels.CPU, TREE_GROUPS, 4, lambda s: s.completion is not None or s.group == 1, window, repeat_prefix=True)


def test_cascade_with_latent_attention_head_sizes():
    _check_cascade(kernels.CPU, TREE_GROUPS, 4, lambda s: True, None, d=12, dv=8)
    _check_cascade(kernels.CPU, TREE_GROUPS, 4, lambda s: True, 3, d=8, dv=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(1, 9), st.lists(st.integers(1, 6), min_size=1, max_size=5)), min_size=1, max_size=3),
    chunk=st.sampled_from([None, 1, 2, 3]),
    window=st.sampled_from([None, 1, 2, 3, 7, "chunk 1", "chunk 3", "chunk 4"]),
    cache_prompts=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cascade_random_trees(spec, chunk, window, cache_prompts, seed):
    groups = [sp.Group(list(range(1, p + 1)), [[1] * t for t in ts]) for p, ts in spec]
    row_of = (lambda s: s.completion is not None) if cache_prompts else (lambda s: True)
    attn_chunk = int(window.split()[1]) if isinstance(window, str) else None
    _check_cascade(kernels.CPU, groups, chunk, row_of, None if attn_chunk else window, seed=seed, chunk=attn_chunk)


def test_cuda_backends_refuse_float32_with_the_fix():
    for name in ("auto", "cuda"):
        with pytest.raises(ValueError, match="takes bfloat16 or float16 tensors, got torch.float32"):
            kernels.select(name, torch.device("cuda"), torch.float32)


def test_a_row_without_any_key_gets_no_nan_in_backward():
    q, k, v = _qkv(0, 3, 2, 2, 2, 4, 4)
    cu_q, cu_k = _cu([2, 1]), _cu([2, 0])  # the second entry's query sees no key
    for impl in IMPLS:
        out, lse = impl.forward(q, k, v, cu_q, cu_k, 2, 2, False, None, 0.5)
        assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
        grads = impl.backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, 2, 2, False, None, 0.5)
        assert all(torch.isfinite(g).all() for g in grads) and (grads[0][2] == 0).all()


@pytest.mark.parametrize("name", sorted(kernels.IMPLEMENTATIONS))
def test_every_backend_takes_the_contracts_arguments_in_order(name):
    impl = kernels.IMPLEMENTATIONS[name]
    assert isinstance(impl.name, str) and isinstance(impl.SOFTCAP, bool)
    for fn in ("forward", "backward"):
        want = list(inspect.signature(getattr(kernels.AttentionKernel, fn)).parameters)
        got = list(inspect.signature(getattr(impl, fn)).parameters)
        assert got[: len(want)] == want, (name, fn, got)
        assert all(p in ("softcap",) for p in got[len(want) :]), (name, fn, got)
