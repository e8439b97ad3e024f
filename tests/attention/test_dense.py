"""Dense dispatch: cascade calls whose entries share one shape run as one batched dense kernel call (``layout.dense``,
``attention.kernels.dense``), exactly; ragged calls stay varlen."""

import pytest
import torch

import sharedprefix as sp
from helpers import TREE_GROUPS, assert_matches_plain_rows, random_groups, tiny_model, tree_mask
from sharedprefix.attention import kernels
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.attention.kernels import dense
from sharedprefix.attention.kernels.dense import DenseCPU, DenseReference, dense_dispatch, disagreement
from sharedprefix.layout import SegmentTree, pack_row
from support.attention import check_cascade


def _bqkv(b, lq, lk, h, hkv, d, dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return r(b, h, lq, d), r(b, hkv, lk, d), r(b, hkv, lk, dv)


@pytest.mark.parametrize("causal, lq, lk", [(True, 7, 7), (False, 5, 11)])
@pytest.mark.parametrize(
    "h, hkv, d, dv", [(4, 2, 6, 6), (4, 1, 12, 8), (2, 2, 8, 12)], ids=["gqa", "mqa_latent", "mha_dv"]
)
def test_dense_cpu_equals_reference(causal, lq, lk, h, hkv, d, dv):
    q, k, v = _bqkv(3, lq, lk, h, hkv, d, dv)
    out, lse, _ = DenseCPU.forward(q, k, v, causal, 0.4)
    want, want_lse, _ = DenseReference.forward(q, k, v, causal, 0.4)
    assert out.shape == (3, h, lq, dv) and lse.shape == (3, h, lq) and lse.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = DenseCPU.backward(dout, q, k, v, out, lse, causal, 0.4)
    for a, b in zip(got, DenseReference.backward(dout, q, k, v, want, want_lse, causal, 0.4)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


class _Log2:
    """A dense kernel whose LSE is in base 2 (flashinfer's convention): the check must refuse it."""

    name = "log2"

    @staticmethod
    def forward(q, k, v, causal, scale):
        o, m, a = DenseCPU.forward(q, k, v, causal, scale)
        return o, m / torch.log(torch.tensor(2.0, dtype=m.dtype)), a

    backward = staticmethod(DenseCPU.backward)


class _NoScale(_Log2):
    name = "no_scale"

    @staticmethod
    def forward(q, k, v, causal, scale):
        return DenseCPU.forward(q, k, v, causal, q.shape[-1] ** -0.5)


class _ZeroGrads(_Log2):
    """Right forward, zero gradients (what cudnn-frontend#462 did with a [heads, tokens] LSE)."""

    name = "zero_grads"
    forward = staticmethod(DenseCPU.forward)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        return tuple(torch.zeros_like(x) for x in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_disagreement_passes_a_right_kernel_and_names_what_is_wrong(dtype):
    assert disagreement(DenseCPU, DenseReference, torch.device("cpu"), dtype) is None
    cpu = torch.device("cpu")
    assert "ratio 1.443; natural-log units" in disagreement(_Log2, DenseReference, cpu, dtype)  # 1 / ln 2
    assert "log-sum-exp" in disagreement(_NoScale, DenseReference, cpu, dtype)
    assert "merged-LSE backward whose dq" in disagreement(_ZeroGrads, DenseReference, cpu, dtype)
    assert "(all zero)" in disagreement(_ZeroGrads, DenseReference, cpu, dtype)


def _row(groups, row_of=lambda s: True, prompt_chunk=None):
    tree = SegmentTree(groups, prompt_chunk=prompt_chunk)
    segs = [s.id for s in tree.segments if row_of(s)]
    cached = {a for s in segs for a in tree.ancestors(s)} - set(segs)
    return pack_row(tree, segs, cached)


def _plan(call):
    """[(B, shape, padded)] of a call's pieces, or None where it stays one varlen call."""
    ps = call.pieces(torch.device("cpu"))
    return None if ps is None else [(p.batch, p.shape, p.lens is not None) for p, _, _ in ps]


def test_which_calls_go_dense():
    one = [sp.Group(list(range(7)), [[1, 2, 3], [4, 5, 6, 7, 8], [9, 9]])]
    own, cross = _row(one).cascade(None).calls
    assert _plan(own) == [(1, (7, 7), False), (3, (5, 5), True)]  # the prompt; the completions right-padded to 5
    assert _plan(cross) == [(1, (10, 7), False)]  # all completions against their prompt: one rectangular entry
    equal = [sp.Group(list(range(6)), [[1, 2], [3, 4, 5]]), sp.Group(list(range(1, 7)), [[6, 7, 8], [9, 1]])]
    own, cross = _row(equal).cascade(None).calls
    assert _plan(own) == [(2, (6, 6), False), (4, (3, 3), True)]
    assert _plan(cross) == [(2, (5, 6), False)]
    unequal = [sp.Group(list(range(6)), [[1, 2], [3, 4, 5]]), sp.Group(list(range(12)), [[6, 7, 8, 1]])]
    own, cross = _row(unequal).cascade(None).calls
    assert _plan(own) == [(1, (6, 6), False), (4, None, False)]  # padded: 4 x 12 > 2 x 21 tokens, so varlen
    assert _plan(cross) == [(1, (5, 6), False), (1, (4, 12), False)]
    (own, cross) = _row(one, lambda s: s.completion is not None).cascade(None).calls  # the prompt cached
    assert _plan(own) == [(1, (3, 3), False), (2, (5, 5), True)]
    assert _plan(cross) == [(1, (10, 7), False)] and cross.keys[0].cached
    ragged = [sp.Group([1, 2], [[1], [2], [3], [4, 5, 6, 7, 8, 9, 1, 2, 3]])]  # padding 4 x 9 > 2 x 12 tokens
    assert _plan(_row(ragged).cascade(None).calls[0]) == [(1, (2, 2), False), (4, None, False)]
    for call in _row(one).cascade(3).calls:  # a window that bites: one gathered, windowed call, varlen
        assert _plan(call) is None


class _Count:
    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        fwd, bwd = DenseCPU.forward, DenseCPU.backward

        def f(*a):
            self.forward += 1
            return fwd(*a)

        def b(*a):
            self.backward += 1
            return bwd(*a)

        monkeypatch.setattr(DenseCPU, "forward", staticmethod(f))
        monkeypatch.setattr(DenseCPU, "backward", staticmethod(b))


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
@pytest.mark.parametrize("dims", [(4, 2, 6, 6), (4, 1, 12, 8)], ids=["gqa", "mqa_latent"])
def test_cascade_with_dense_pieces_equals_explicit_tree_attention(monkeypatch, window, prompt_chunk, cached, dims):
    """Trees (long prompts cut into chains), cached prompts, windows, GQA and Dv != D, forward and backward: float64
    to 1e-12 / 1e-10 against explicit attention over the tree (``check_cascade``); dense pieces ran unless a window
    bites."""
    count = _Count(monkeypatch)
    h, hkv, d, dv = dims
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    check_cascade(kernels.CPU, TREE_GROUPS, prompt_chunk, row_of, window, h=h, hkv=hkv, d=d, dv=dv)
    if window is None:
        assert count.forward > 0 and count.backward == count.forward
    else:
        assert count.forward == 0


def _cascade_error(groups, dtype):
    """Max error against float64 of the cascade in ``dtype`` and of explicit same-dtype attention, out and grads."""
    tree = SegmentTree(groups)
    row = pack_row(tree, [s.id for s in tree.segments], set())
    n = row.length
    g = torch.Generator().manual_seed(3)
    q64, k64, v64 = (torch.randn(n, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(n, 4, 16, generator=g, dtype=torch.float64)
    ok = tree_mask(tree)

    def explicit(q, k, v):
        s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(2, 1)) * 0.25
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
        return torch.einsum("hij,jhd->ihd", p, v.repeat_interleave(2, 1))

    def cascade(q, k, v):
        m = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        return cascade_attention(kernels.CPU, row.cascade(None), m(q), m(k), m(v), None, 0.25)[0]

    def run(fn, dt):
        xs = [x.to(dt).requires_grad_(True) for x in (q64, k64, v64)]
        out = fn(*xs)
        grads = torch.autograd.grad((out * dout.to(dt)).sum(), xs)
        return [out.double()] + [x.double() for x in grads]

    want = run(explicit, torch.float64)
    err = lambda got: [(a - b).abs().max().item() for a, b in zip(got, want)]  # noqa: E731
    return err(run(cascade, dtype)), err(run(explicit, dtype))


def test_dense_float32_within_twice_the_plain_error(monkeypatch):
    """The 2x rule in float32: the cascade on dense pieces errs at most twice as much as explicit float32 attention,
    for the output and each gradient (rows in segment order: ``pack_row`` of the whole tree keeps it)."""
    count = _Count(monkeypatch)
    groups = [sp.Group(list(range(40)), [list(range(9)), list(range(13)), list(range(11))])]
    mine, plain = _cascade_error(groups, torch.float32)
    assert count.forward > 0 and count.backward > 0
    for a, b in zip(mine, plain):
        assert 0 < a <= 2 * b


@pytest.mark.parametrize("on", [True, False], ids=["dense", "varlen"])
@pytest.mark.parametrize("budget, mode", [(None, None), (14, "keep"), (14, "recompute"), (9, "offload")])
def test_logprobs_and_backward_match_plain_rows_dense_on_and_off(monkeypatch, on, budget, mode):
    """sp.logprobs and sp.backward against the plain rows (1e-9), dense dispatch on and off; budgets that split a group
    (its prompt cached, a chain where it is longer than the budget)."""
    count = _Count(monkeypatch)
    model = tiny_model("qwen3")
    groups = random_groups(0, 2, [10, 6], [[3, 4, 2], [5, 1]])
    with dense_dispatch(on):
        assert dense.dense_enabled() is on
        assert_matches_plain_rows(model, groups, budget=budget, mode=mode)
    assert (count.forward > 0 and count.backward > 0) if on else count.forward == count.backward == 0


def test_dense_calls_per_layer(monkeypatch):
    """One group of 16 completions: per layer the prompt's causal call (one entry), the 16 completions' own causal call
    as one padded batch, and all completions against their prompt as one rectangular entry; no varlen call."""
    seen, varlen = [], []
    fwd, vfwd = DenseCPU.forward, kernels.CPU.forward
    monkeypatch.setattr(
        DenseCPU,
        "forward",
        staticmethod(
            lambda q, k, v, causal, scale: (
                seen.append((q.shape[0], q.shape[2], k.shape[2], causal)) or fwd(q, k, v, causal, scale)
            )
        ),
    )
    monkeypatch.setattr(kernels.CPU, "forward", staticmethod(lambda *a: varlen.append(a) or vfwd(*a)))
    model = tiny_model("llama")
    with torch.no_grad():
        sp.logprobs(model, random_groups(0, 1, [50], [[4] * 15 + [3]]))
    assert seen == [(1, 50, 50, True), (16, 4, 4, True), (1, 63, 50, False)] * model.config.num_hidden_layers
    assert varlen == []
