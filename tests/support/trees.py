"""Prefix trees from random rows, and the check of a tree against one plain forward per row (float64)."""

import torch
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import assert_grads_close, grads_of


def plain_rows(model, rows, trained):
    """(N, L) log p(row[t] | row[:t]) where trained and t >= 1 (zero elsewhere), one plain forward per row."""
    L = max(len(r) for r in rows)
    out = []
    for r, m in zip(rows, trained):
        ids = torch.tensor(r)[None]
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].double(), -1)
        lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
        keep = torch.tensor(m[1:], dtype=torch.bool)
        out.append(torch.nn.functional.pad(torch.where(keep, lp, torch.zeros_like(lp)), (1, L - len(r))))
    return torch.stack(out)


def tree_rows(spec):
    """Rows that share prefixes: each continues a random cut of an earlier row (a prefix, a branch, a copy)."""
    rows = []
    for parent, cut, suffix, _ in spec:
        base = rows[parent % len(rows)][:cut] if rows else []
        row = base + suffix
        rows.append(row or [1])
    return rows


def masks(rows, spec):
    return [
        [bool((j * 7 + k + seed) % 3) for j in range(len(r))] for k, (r, (_, _, _, seed)) in enumerate(zip(rows, spec))
    ]


ROW_SPEC = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 14), st.lists(st.integers(0, 5), max_size=6), st.integers(0, 5)),
    min_size=1,
    max_size=7,
)


def _assert_grads(got, want):
    if all(float(g.abs().max()) == 0 for g in want.values()):  # nothing trained: no gradient anywhere
        assert all(float(g.abs().max()) == 0 for g in got.values())
        return
    assert_grads_close(got, want, 1e-9)


def check_tree(model, rows, trained, budgets=(None,), modes=("keep",)):
    """``sp.logprobs`` (values, mask, gradient) and ``sp.backward`` (each budget and prefix mode) on the tree of
    ``rows`` against one plain float64 forward per row: log-probs to 1e-9, gradients to a relative 1e-9."""
    tree = sp.Tree.from_rows(rows, trained)
    ref = plain_rows(model, rows, trained).detach()
    want_mask = torch.zeros(ref.shape, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, trained)):
        want_mask[i, 1 : len(r)] = torch.tensor(m[1:], dtype=torch.bool)
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(rows)))
    want = grads_of(model, lambda: (plain_rows(model, rows, trained) * w).sum())
    for budget in budgets:
        with torch.no_grad():
            out = sp.logprobs(model, tree, max_tokens=budget)
        assert out.logprobs.shape == ref.shape and torch.equal(out.mask, want_mask)
        assert (out.logprobs - ref).abs().max() <= 1e-9
        got = grads_of(model, lambda budget=budget: (sp.logprobs(model, tree, max_tokens=budget).logprobs * w).sum())
        _assert_grads(got, want)
        for mode in modes:

            def loss(b):
                assert b.logprobs.shape[1] == ref.shape[1] and torch.equal(b.mask, want_mask[b.index.cpu()])
                return (b.logprobs * w[b.index]).sum()

            def run(loss=loss, budget=budget, mode=mode):
                sp.backward(model, tree, loss, max_tokens=budget, prefix_activations=mode)

            got = grads_of(model, run)
            _assert_grads(got, want)
