"""The attention primitive and the cascade over the tree, against explicit float64 attention."""

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import TREE_GROUPS
from sharedprefix.attention import kernels
from sharedprefix.layout import SegmentTree, pack_row
from support.attention import check_cascade, dense_attention, qkv

IMPLS = [kernels.CPU, kernels.Reference]


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
    q, k, v = qkv(0, sum(lq), sum(lk), h, hkv, d, dv)
    allowed = _entry_mask(lq, lk, causal, window)
    scale = 0.37
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    want, want_lse = dense_attention(q_, k_, v_, allowed, scale)
    call = kernels.KernelCall(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, scale)
    out, lse = impl.forward(call)
    assert out.shape == want.shape and lse.shape == want_lse.shape and lse.dtype == torch.float64
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=0, atol=1e-12)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    want.backward(g)
    dq, dk, dvv = impl.backward(call, g, out, lse)
    for got, ref in ((dq, q_.grad), (dk, k_.grad), (dvv, v_.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "impl, dims, case",
    [  # the long causal case on the CPU flash kernel is slow; on the reference kernel it stays in the inner loop
        pytest.param(
            impl,
            dims,
            case,
            id=f"{case}-{dims_id}-{impl.name}",
            marks=pytest.mark.slow if (case, impl) == ("causal_square", kernels.CPU) else (),
        )
        for case in sorted(CASES)
        for dims_id, dims in (("d", (8, 8)), ("dv_smaller", (12, 6)))
        for impl in IMPLS
    ],
)
def test_softcapped_primitive_matches_explicit_attention(impl, dims, case, monkeypatch):
    """Soft-capped scores (Gemma 2): tiles of 4 queries and blocks of 3 keys, so that the CPU path merges blocks."""
    monkeypatch.setattr(kernels.cpu, "TILE", 4)
    monkeypatch.setattr(kernels.cpu, "KEY_BLOCK", 3)
    lq, lk, causal, window = CASES[case]
    q, k, v = qkv(2, sum(lq), sum(lk), 4, 2, *dims)
    q = q * 4  # scores of several units, where tanh(s / 1.5) caps visibly
    allowed = _entry_mask(lq, lk, causal, window)
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    want, want_lse = dense_attention(q_, k_, v_, allowed, 0.37, softcap=1.5)
    plain, _ = dense_attention(q, k, v, allowed, 0.37)
    if case != "window_zero":  # (one key per query there: any scores give the same output)
        assert (plain - want).abs().max() > 1e-2  # the cap changes the result: the comparison below can fail
    call = kernels.KernelCall(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal, window, 0.37, softcap=1.5)
    out, lse = impl.forward(call)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=0, atol=1e-12)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    want.backward(g)
    grads = impl.backward(call, g, out, lse)
    for got, ref in zip(grads, (q_.grad, k_.grad, v_.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_softcapped_cpu_primitive_in_float32_and_bfloat16_stays_near_float64():
    lq = lk = [40, 3, 17]
    q, k, v = qkv(3, 60, 60, 4, 2, 16, 16)
    want, want_lse = kernels.Reference.forward(
        kernels.KernelCall(q, k, v, _cu(lq), _cu(lk), 40, 40, True, None, 0.25, softcap=2.0)
    )
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        x = (q.to(dtype), k.to(dtype), v.to(dtype))
        out, lse = kernels.CPU.forward(kernels.KernelCall(*x, _cu(lq), _cu(lk), 40, 40, True, None, 0.25, softcap=2.0))
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() < tol and (lse.double() - want_lse).abs().max() < tol


def test_cpu_primitive_in_float32_and_bfloat16_stays_near_float64():
    lq = lk = [40, 3, 17]
    q, k, v = qkv(3, 60, 60, 4, 2, 16, 16)
    want, want_lse = kernels.Reference.forward(kernels.KernelCall(q, k, v, _cu(lq), _cu(lk), 40, 40, True, None, 0.25))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        x = (q.to(dtype), k.to(dtype), v.to(dtype))
        out, lse = kernels.CPU.forward(kernels.KernelCall(*x, _cu(lq), _cu(lk), 40, 40, True, None, 0.25))
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() < tol and (lse.double() - want_lse).abs().max() < tol


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("window", [None, 1, 2, 5, 12, 100])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_cascade_equals_explicit_tree_attention(impl, window, prompt_chunk, cached):
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    check_cascade(impl, TREE_GROUPS, prompt_chunk, row_of, window)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_chunked_cascade_equals_explicit_tree_attention(impl, chunk, prompt_chunk, cached):
    """Chunks of positions (Llama 4): a completion continues its prompt's chunk, whose keys may lie in the prompt."""
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    check_cascade(impl, TREE_GROUPS, prompt_chunk, row_of, None, chunk=chunk)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.name)
@pytest.mark.parametrize("window", [None, 1, 2, 3, 6, 100])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_bidirectional_blocks_equal_explicit_attention(impl, window, cached):
    """Gemma 3's image tokens: each block also sees its own later keys, AND(window, OR(causal, block)); blocks
    longer than the window, of one token, touching, at a prompt's start and end, in several prompts of the row."""
    groups = [
        sp.Group(list(range(1, 11)), [[1, 2, 3], [4], [5, 6]]),
        sp.Group([7, 8, 9, 10, 11], [[1, 2]]),
        sp.Group([3, 4, 5, 6], [[7]]),
    ]
    tree = SegmentTree(groups)
    roots = [s.id for s in tree.segments if s.parent is None]
    blocks = [
        (roots[0], 0, 3),
        (roots[0], 3, 4),
        (roots[0], 4, 5),
        (roots[0], 6, 10),
        (roots[1], 1, 4),
        (roots[2], 0, 4),
    ]
    row_of = (lambda s: s.completion is not None or s.group != 1) if cached else (lambda s: True)
    in_row = [b for b in blocks if row_of(tree.segments[b[0]])]
    check_cascade(impl, groups, None, row_of, window, blocks=in_row)


def test_blocks_fail_the_cascade_test_without_their_call():
    """The reference sees the blocks: a cascade that ignored them would not match it."""
    groups = [sp.Group(list(range(1, 7)), [[1, 2]])]
    root = SegmentTree(groups).segments[0].id
    with pytest.raises(AssertionError):
        check_cascade(kernels.Reference, groups, None, lambda s: True, None, blocks=[(root, 1, 4)], drop_blocks=True)


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
    check_cascade(
        kernels.CPU, TREE_GROUPS, 4, lambda s: s.completion is not None or s.group == 1, window, repeat_prefix=True
    )


def test_cascade_with_latent_attention_head_sizes():
    check_cascade(kernels.CPU, TREE_GROUPS, 4, lambda s: True, None, d=12, dv=8)
    check_cascade(kernels.CPU, TREE_GROUPS, 4, lambda s: True, 3, d=8, dv=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 9), st.lists(st.integers(1, 6), min_size=1, max_size=5)), min_size=1, max_size=3
    ),
    chunk=st.sampled_from([None, 1, 2, 3]),
    window=st.sampled_from([None, 1, 2, 3, 7, "chunk 1", "chunk 3", "chunk 4"]),
    cache_prompts=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cascade_random_trees(spec, chunk, window, cache_prompts, seed):
    groups = [sp.Group(list(range(1, p + 1)), [[1] * t for t in ts]) for p, ts in spec]
    row_of = (lambda s: s.completion is not None) if cache_prompts else (lambda s: True)
    attn_chunk = int(window.split()[1]) if isinstance(window, str) else None
    check_cascade(kernels.CPU, groups, chunk, row_of, None if attn_chunk else window, seed=seed, chunk=attn_chunk)


def test_cuda_backends_refuse_float32_with_the_fix():
    for name in ("auto", "cuda"):
        with pytest.raises(ValueError, match="takes bfloat16 or float16 tensors, got torch.float32"):
            kernels.select(name, torch.device("cuda"), torch.float32)


def test_a_row_without_any_key_gets_no_nan_in_backward():
    q, k, v = qkv(0, 3, 2, 2, 2, 4, 4)
    cu_q, cu_k = _cu([2, 1]), _cu([2, 0])  # the second entry's query sees no key
    for impl in IMPLS:
        call = kernels.KernelCall(q, k, v, cu_q, cu_k, 2, 2, False, None, 0.5)
        out, lse = impl.forward(call)
        assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
        grads = impl.backward(call, torch.ones_like(out), out, lse)
        assert all(torch.isfinite(g).all() for g in grads) and (grads[0][2] == 0).all()


@pytest.mark.parametrize("name", sorted(kernels.BACKENDS))
def test_every_backend_takes_the_contracts_arguments_in_order(name):
    impl = kernels.BACKENDS[name].kernel
    assert impl.name == name and isinstance(impl.SOFTCAP, bool)
    for fn in ("forward", "backward"):
        want = list(inspect.signature(getattr(kernels.AttentionKernel, fn)).parameters)
        got = list(inspect.signature(getattr(impl, fn)).parameters)
        assert got == want, (name, fn, got)


def test_backends_without_softcapping_refuse_a_softcapped_call():
    q, k, v = qkv(0, 3, 3, 2, 2, 4, 4)
    call = kernels.KernelCall(q, k, v, _cu([3]), _cu([3]), 3, 3, True, None, 0.5, softcap=2.0)
    for name, b in kernels.BACKENDS.items():
        if not b.softcap:
            with pytest.raises(ValueError, match=f"backend {name!r} has no attention-score soft-capping"):
                b.kernel.forward(call)


def test_select_reads_the_backend_table():
    assert kernels.select("auto", torch.device("cpu")) is kernels.CPU
    assert kernels.select("eager", torch.device("cpu")) is kernels.Reference
    for name, b in kernels.BACKENDS.items():
        if "cpu" in b.devices:
            assert kernels.select(name, torch.device("cpu"), torch.float64) is b.kernel
        else:
            with pytest.raises(ValueError, match=f"backend {name!r} needs CUDA tensors, got cpu"):
                kernels.select(name, torch.device("cpu"))
