"""Tiny random-weight models and the plain reference computation every test compares against."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import sharedprefix as sp
from sharedprefix.tools.reference import dtype_faithful_norms as float64_faithful  # noqa: F401
from sharedprefix.tools.reference import plain_logprobs  # noqa: F401

VOCAB = 97


# the tests' own settings on top of the zoo's tiny sizes (``sharedprefix.tools.zoo.configs``: width 32, 2 layers,
# 4 heads over 2 K/V heads, vocabulary 97); any other model type gets the zoo's tiny config as it is
TEST_SETTINGS = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": dict(head_dim=12),  # head_dim != hidden / heads
    "gemma": dict(head_dim=8, num_key_value_heads=1),  # MQA
    "phi3": dict(num_key_value_heads=4, pad_token_id=0, sliding_window=None),
    "gpt2": dict(n_positions=512, n_inner=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def tiny_model(model_type="qwen3", dtype=torch.float64, seed=0, attn="sdpa", **overrides):
    """The zoo's tiny ``model_type`` (its causal-LM class), ``TEST_SETTINGS`` and ``overrides`` set on its config,
    positions up to 512, weights drawn after ``torch.manual_seed(seed)``, in ``dtype``, eval mode; float64 models
    with norms that stay float64 (``float64_faithful``)."""
    from sharedprefix.tools import zoo

    settings = {"max_position_embeddings": 512, **TEST_SETTINGS.get(model_type, {}), **overrides}
    cfg = zoo.tiny_config(model_type, **settings)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(tf, zoo.entries()[model_type])(cfg).to(dtype)
    model.eval()
    if dtype == torch.float64:
        float64_faithful(model)
    return model


KERNEL_PATHS = ("cpu", "reference")  # the ``kernel_path`` fixture's parameters (conftest.py)


def on_kernel_paths(values, slow=()) -> list:
    """Each kernel path with each of ``values``, for ``@pytest.mark.parametrize("kernel_path, name", ...,
    indirect=["kernel_path"])``; the (path, value) pairs in ``slow`` marked ``slow``. A pair that is not among them is
    refused, so that renaming a case cannot drop its mark silently."""
    pairs = [(k, v) for k in KERNEL_PATHS for v in values]
    if unknown := set(slow) - set(pairs):
        raise ValueError(f"slow cases {sorted(unknown)} are not among the parameters {pairs}")
    return [pytest.param(k, v, marks=pytest.mark.slow) if (k, v) in slow else (k, v) for k, v in pairs]


def call_source(source):
    """What a call was given, seen through a reused plan: a ``CallPlan``'s groups or tree (TRL's trainers pass plans
    since they plan once per batch), anything else as it is."""
    return source.source if isinstance(source, sp.CallPlan) else source


def random_groups(seed, n_groups, prompt_lens, completion_lens, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_groups):
        p = torch.randint(0, vocab, (prompt_lens[i],), generator=g)
        cs = [torch.randint(0, vocab, (t,), generator=g) for t in completion_lens[i]]
        out.append(sp.Group(p, cs))
    return out


def grads_of(model, fn):
    """Run fn() -> scalar, backward, and return {name: grad clone}; grads are zeroed first and after."""
    model.zero_grad(set_to_none=True)
    loss = fn()
    if loss is not None:
        loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def refused_on_second_call(loss_fn):
    """``loss_fn`` that raises ``ValueError("second pass refused")`` on its second call, after a first call whose
    backward accumulated gradients: a call that fails part-way."""
    seen = []

    def failing(b):
        seen.append(1)
        if len(seen) == 2:
            raise ValueError("second pass refused")
        return loss_fn(b)

    return failing


def assert_grads_close(got, want, rtol):
    """Every gradient within ``rtol`` of the reference, relative to its own largest entry; a tensor whose
    exact gradient is zero (e.g. q_proj when every query attends to a single key) is held to
    ``rtol * 1e-6`` of the largest gradient of the model instead of to its own rounding noise."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 1e-6 * max(float(w.abs().max()) for w in want.values())
    for n in want:
        scale = want[n].abs().max().clamp_min(floor)
        err = (got[n] - want[n]).abs().max() / scale
        assert err <= rtol, f"{n}: relative error {float(err):.3g} > {rtol}"


def assert_matches_plain_rows(model, groups, budget=None, mode=None, plain=None):
    """``sp.logprobs`` (1e-9) and ``sp.backward``'s parameter gradients of a per-completion weighted sum (relative
    1e-9) equal to one plain forward per row, under ``budget``; a budget must split a group (its prompt cached, its
    completions later), or the check would not exercise the schedule. ``plain(model, groups)`` -> (N, T) log-probs
    (default: ``plain_logprobs``). Returns the gradients, for further checks."""
    plain = plain or (lambda m, gs: plain_logprobs(m, gs)[0])
    if budget is not None:
        assert any(isinstance(s, sp.schedule.PrefixBackward) for s in sp.plan(groups, budget).steps)
    ref = plain(model, groups).detach()
    with torch.no_grad():
        out = sp.logprobs(model, groups, max_tokens=budget)
    assert (out.logprobs - ref).abs().max() <= 1e-9
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain(model, groups) * w).sum())
    got = grads_of(
        model,
        lambda: (
            sp.backward(
                model, groups, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=budget, prefix_activations=mode
            )
            and None
        ),
    )
    assert_grads_close(got, want, 1e-9)
    return got


# groups whose tree has a long prompt (cut into chains by a budget), a one-token prompt and several completions
TREE_GROUPS = [
    sp.Group(list(range(1, 12)), [[1, 2, 3], [4], [5, 6]]),
    sp.Group([3], [[7, 7, 7, 7]]),
    sp.Group([9, 8, 7, 6], [[1], [2]]),
]


def tree_mask(tree, window=None, chunk=None, blocks=()) -> torch.Tensor:
    """(T, T) bool over every token of ``tree`` (segments in id order): which keys each query may attend to, built
    from the definition (ancestors whole, own segment causally, or inside the same bidirectional block, given as
    (segment id, start, end) segment-local; then positions within the window, or in the query's chunk of
    positions: Gemma 3's AND(window, OR(causal, block))). Tests only."""
    seg = torch.cat([torch.full((s.length,), s.id) for s in tree.segments])
    pos = torch.cat([torch.arange(s.start, s.end) for s in tree.segments])
    anc = [set(tree.ancestors(s.id)) for s in tree.segments]
    is_anc = torch.tensor([[b in anc[a] for b in range(len(anc))] for a in range(len(anc))])
    ok = is_anc[seg[:, None], seg[None, :]] | ((seg[:, None] == seg[None, :]) & (pos[None] <= pos[:, None]))
    block = torch.full(seg.shape, -1)
    for i, (s, a, b) in enumerate(blocks):
        off = sum(t.length for t in tree.segments[:s])
        block[off + a : off + b] = i
    ok |= (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    if window is not None:
        ok &= (pos[:, None] - pos[None]) < window
    if chunk is not None:
        ok &= (pos[:, None] // chunk) == (pos[None] // chunk)
    return ok
