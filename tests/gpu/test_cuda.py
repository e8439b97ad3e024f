"""CUDA: the varlen flash primitive, the cascade and sp.logprobs / sp.backward in bf16 (skipped without a GPU).

bf16 rule (flash-attention's): the error of the fast path against float64 is at most twice the error of the
plain same-dtype computation against float64. For the primitive the plain computation is flash-attention's own
test baseline: attention written out in bf16 (scores, softmax and output each rounded to bf16). For whole models
it is the plain transformers forward of each row in bf16.
"""

import pytest
import torch
import torch.nn.functional as F

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model
from sharedprefix.attention import kernels
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.layout import SegmentTree, pack_row
from support.bf16 import MODELS, backward_logprobs, bf16_rule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = {  # name -> (queries per entry, keys per entry, causal, window, D, Dv[, KV heads]); 8 query heads, 2 KV heads
    "causal": ([5, 1, 300, 7], [5, 1, 300, 7], True, None, 128, 128),
    "causal_mha": ([5, 1, 300, 7], [5, 1, 300, 7], True, None, 128, 128, 8),
    "dense_d64": ([9, 130], [40, 700], False, None, 64, 64),
    "dense": ([4, 9, 130], [6, 2, 700], False, None, 128, 128),
    "causal_window": ([300, 1, 12], [300, 1, 12], True, 63, 128, 128),
    # max_seqlen_q == 1 with GQA and an entry without queries: flash's single-query path must not be taken
    "single_query_gqa": ([1, 0, 1], [5, 3, 7], False, None, 128, 128),
    "latent_dims": ([7, 33], [7, 90], True, None, 192, 128),  # Dv != D: padded to one head size
    "head_dim_12": ([5, 60], [5, 60], True, 7, 12, 12),  # not a multiple of 8: padded (tiny qwen3's head_dim)
    # bidirectional image blocks (Gemma 3): non-causal, window 0, a gap entry without queries
    "upper_blocks": ([255, 0, 15], [255, 4, 15], False, 0, 128, 128),
}


def _cu(xs):
    return torch.tensor([0] + list(torch.tensor(xs).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


def _math_entries(q, k, v, lq, lk, causal, window, scale):
    """The plain same-dtype computation, as flash-attention's tests write it: per entry, bf16 scores with the
    contract's mask, a softmax rounded to bf16, a bf16 product with V.

    (SDPA's memory-efficient kernel keeps more in float32: on the first H200 run its dq error on the head_dim-12
    windowed case was 0.0043 against flash's 0.0095; flash rounds dS to bf16 before dQ = dS K.)"""
    outs, a, b = [], 0, 0
    n = q.shape[1] // k.shape[1]
    for nq, nk in zip(lq, lk):
        if nq == 0:  # an entry without queries adds no rows
            b += nk
            continue
        i = torch.arange(nq, device=q.device)[:, None] + nk - nq
        j = torch.arange(nk, device=q.device)[None]
        ok = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if causal:
            ok &= j <= i
        if window is not None:
            ok &= j >= i - window
        t = lambda x: x.transpose(0, 1)  # noqa: E731  (heads, tokens, dim)
        scores = (t(q[a : a + nq]) * scale) @ t(k[b : b + nk].repeat_interleave(n, 1)).transpose(1, 2)
        p = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1)
        outs.append((p @ t(v[b : b + nk].repeat_interleave(n, 1))).transpose(0, 1))
        a, b = a + nq, b + nk
    return torch.cat(outs)


@pytest.mark.parametrize("name", ["cuda", "flash_attn"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_primitive_bf16_within_twice_plain_error(name, case):
    if name == "flash_attn":
        pytest.importorskip("flash_attn")
    impl = kernels.select(name, torch.device("cuda"))
    lq, lk, causal, window, d, dv, *hkv = CASES[case]
    hkv = hkv[0] if hkv else 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lq), 8, d, device="cuda", generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, device="cuda", generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, dv, device="cuda", generator=g, dtype=torch.float64)
    q16, k16, v16 = (x.bfloat16().requires_grad_(True) for x in (q, k, v))
    scale = d**-0.5
    args = (_cu(lq), _cu(lk), max(lq), max(lk), causal, window, scale)
    ref_call = kernels.KernelCall(q16.double(), k16.double(), v16.double(), *args)
    ref, ref_lse = kernels.Reference.forward(ref_call)
    call = kernels.KernelCall(q16.detach(), k16.detach(), v16.detach(), *args)
    out, lse, *aux = impl.forward(call)
    plain = _math_entries(q16, k16, v16, lq, lk, causal, window, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (sum(lq), 8)
    assert out.shape == (sum(lq), 8, dv)
    assert (lse.double() - ref_lse).abs().max() < 1e-3
    assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + 1e-6
    dout = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.float64).bfloat16()
    plain.backward(dout)
    rq, rk, rv = kernels.Reference.backward(ref_call, dout.double(), ref, ref_lse)
    got = impl.backward(call, dout, out, lse, aux[0] if aux else None)
    for mine, pl, r in zip(got, (q16.grad, k16.grad, v16.grad), (rq, rk, rv)):
        assert (mine.double() - r).abs().max() <= 2 * (pl.double() - r).abs().max() + 1e-6


def test_cuda_head_padding_changes_nothing():
    """A head size that is not a multiple of 8 is zero-padded inside the CUDA wrapper: the result and the gradients
    equal the wrapper's own on inputs the caller padded (same kernel, same arithmetic), up to one bf16 rounding
    (dq is accumulated with atomic adds, in no fixed order)."""
    impl = kernels.select("cuda", torch.device("cuda"))
    lq, lk, causal, window, d, _ = CASES["head_dim_12"]
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(sum(n), h, d, device="cuda", generator=g).bfloat16() for n, h in ((lq, 8), (lk, 2), (lk, 2)))
    dout = torch.randn(sum(lq), 8, d, device="cuda", generator=g).bfloat16()
    args = (_cu(lq), _cu(lk), max(lq), max(lk), causal, window, d**-0.5)
    runs = []
    for pad in (0, 16 - d):
        x = [F.pad(t, (0, pad)) for t in (q, k, v, dout)]
        call = kernels.KernelCall(*x[:3], *args)
        out, lse, *aux = impl.forward(call)
        grads = impl.backward(call, x[3], out, lse, aux[0] if aux else None)
        runs.append([t[..., :d].float() for t in (out, *grads)] + [lse])
    for a, b in zip(*runs):
        assert (a - b).abs().max() <= 2**-8 * a.abs().max(), float((a - b).abs().max())


@pytest.mark.parametrize("name", ["cuda", "flash_attn"])
def test_cuda_primitive_rows_without_keys(name):
    """Queries that see no key (causal with more queries than keys; an entry with no keys): out 0 and LSE -inf
    (flash itself writes +inf), and a backward given that LSE gives them zero gradient, not NaN."""
    if name == "flash_attn":
        pytest.importorskip("flash_attn")
    impl = kernels.select(name, torch.device("cuda"))
    lq, lk, scale = [6, 3, 5], [3, 0, 9], 64**-0.5
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=g).bfloat16() for n, h in ((14, 8), (12, 2), (12, 2)))
    args = (_cu(lq), _cu(lk), max(lq), max(lk), True, None, scale)
    ref_call = kernels.KernelCall(q.double(), k.double(), v.double(), *args)
    ref, ref_lse = kernels.Reference.forward(ref_call)
    call = kernels.KernelCall(q, k, v, *args)
    out, lse, *aux = impl.forward(call)
    none = torch.isinf(ref_lse)  # rows 0-2 and 6-8
    assert int(none.all(1).sum()) == 6
    assert torch.equal(torch.isinf(lse), none) and bool((lse[none] < 0).all())
    assert bool((out[none.all(1)] == 0).all())
    assert (out.double() - ref).abs().max() < 3e-2 and (lse.double() - ref_lse)[~none].abs().max() < 1e-3
    dout = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    got = impl.backward(call, dout, out, lse, aux[0] if aux else None)
    # the float64 reference with +inf where no key (exp(S - lse) = 0 there; -inf would give NaN in its formula)
    want = kernels.Reference.backward(ref_call, dout.double(), ref, ref_lse.masked_fill(none, float("inf")))
    for mine, r in zip(got, want):
        assert mine.shape == r.shape and bool(torch.isfinite(mine).all())
        assert (mine.double() - r).abs().max() <= 0.05 * r.abs().max() + 1e-3
    assert bool((got[0][none.all(1)] == 0).all())


@pytest.mark.parametrize(
    "window, chunk, blocks",
    [(None, None, False), (3, None, False), (None, 8, False), (None, None, True), (3, None, True)],
    ids=["full", "window", "chunked", "blocks", "blocks_window"],
)
def test_cuda_cascade_matches_cpu_cascade(window, chunk, blocks):
    """The same cascade (chains, several groups, cached prompts; chunked attention; Gemma 3's bidirectional blocks)
    on CUDA bf16 vs the CPU float64 run. (Not yet run on a GPU for the chunked and block cases.)"""
    tree = SegmentTree(
        [sp.Group(list(range(1, 40)), [[1] * 9, [2] * 3]), sp.Group([3, 4], [[5] * 17])], prompt_chunk=16
    )
    row = pack_row(tree, [s.id for s in tree.segments], set())
    if blocks:
        row.blocks = [(2, 12), (12, 14), (20, 31)]
    L = row.length
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, L, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    want = cascade_attention(kernels.CPU, row.cascade(window, chunk), q, k, v, None, 0.125)
    qkv = [x.cuda().bfloat16().requires_grad_(True) for x in (q, k, v)]
    got = cascade_attention(kernels.CUDA, row.cascade(window, chunk), *qkv, None, 0.125)
    assert (got.double().cpu() - want).abs().max() < 3e-2
    q64, k64, v64 = (x.clone().requires_grad_(True) for x in (q, k, v))
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    cascade_attention(kernels.CPU, row.cascade(window, chunk), q64, k64, v64, None, 0.125).backward(dout)
    got.backward(dout.cuda().bfloat16())
    for mine, ref in zip(qkv, (q64, k64, v64)):
        assert (mine.grad.double().cpu() - ref.grad).abs().max() < 5e-2 * ref.grad.abs().max()


def _grad_vector(model, names):
    return torch.cat([model.get_parameter(n).grad.double().cpu().flatten() for n in names])


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_backward_gradients_bf16_within_twice_plain_error(mode):
    """Parameter gradients of sum(log-probs) by the 2x rule: |ours - float64| <= 2 |plain bf16 - float64|, over
    all parameters together (L2), and each parameter tensor within 4x of the plain bf16 error (plus a quarter
    of one bf16 rounding of its largest entry, for tensors whose plain error is near zero)."""
    model64 = tiny_model("qwen3", dtype=torch.float64)
    groups = random_groups(5, 3, [300, 7, 180], [[120, 3, 90, 9], [20], [5, 50, 5, 1, 160]])
    names = [n for n, _ in model64.named_parameters()]
    plain_logprobs(model64, groups)[0].sum().backward()
    exact = torch.cat([p.grad.flatten() for _, p in model64.named_parameters()])
    model16 = tiny_model("qwen3", dtype=torch.bfloat16).cuda()
    model16.load_state_dict({k: v.bfloat16() for k, v in model64.state_dict().items()})
    plain_logprobs(model16, groups)[0].sum().backward()
    plain16 = _grad_vector(model16, names)
    model16.zero_grad(set_to_none=True)
    sp.backward(model16, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=256, prefix_activations=mode)
    ours = _grad_vector(model16, names)
    plain_err, ours_err = (plain16 - exact).norm(), (ours - exact).norm()
    assert ours_err <= 2 * plain_err, (float(ours_err), float(plain_err))
    worst, a = [], 0
    for n, p in model64.named_parameters():
        sl = slice(a, a + p.numel())
        a += p.numel()
        floor = 1e-3 * exact[sl].abs().max()  # a quarter of one bf16 rounding of the tensor's largest entry
        worst.append((float((ours[sl] - exact[sl]).abs().max() / ((plain16[sl] - exact[sl]).abs().max() + floor)), n))
    assert max(worst)[0] <= 4, sorted(worst)[-3:]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_logprobs_and_backward_bf16_within_twice_plain_error(model):
    arch, kw = MODELS[model]
    model64 = tiny_model(arch, dtype=torch.float64, **kw)
    groups = random_groups(4, 3, [300, 7, 180], [[120, 3, 90, 9], [20], [5, 50, 5, 1, 160]])
    with torch.no_grad():
        bf16_rule(model64, groups, lambda m: sp.logprobs(m, groups).logprobs, arch, **kw)
    for mode in ("keep", "offload", "recompute"):
        bf16_rule(model64, groups, lambda m, mode=mode: backward_logprobs(m, groups, mode), arch, **kw)


@pytest.mark.parametrize("budget", [None, 256])
def test_autocast_over_float32_weights_within_twice_plain_error(budget):
    """Mixed precision as TRL/accelerate run it (float32 weights, CUDA autocast to bf16): the attention casts q/k/v as
    autocast casts the plain SDPA; log-probs within twice the plain autocast run's error against float64."""
    model64 = tiny_model("qwen3", dtype=torch.float64, head_dim=128)
    groups = random_groups(4, 3, [300, 7, 180], [[120, 3, 90, 9], [20], [5, 50, 5, 1, 160]])
    model32 = tiny_model("qwen3", dtype=torch.float32, head_dim=128).cuda()
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    exact, _ = plain_logprobs(model64, groups)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        plain = plain_logprobs(model32, groups)[0]
        ours = sp.logprobs(model32, groups, max_tokens=budget).logprobs
    plain_err = (plain.double().cpu() - exact).abs().max()
    assert 1e-4 < plain_err  # autocast really ran in bf16
    assert (ours.double().cpu() - exact).abs().max() <= 2 * plain_err + 1e-6
