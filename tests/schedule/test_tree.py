"""Prefix trees: sp.logprobs / sp.backward on any rows against one plain forward per row, in float64."""

import pytest
import torch
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, tiny_model

_MODEL = tiny_model("qwen2", seed=3)


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


def _tree_rows(spec):
    """Rows that share prefixes: each continues a random cut of an earlier row (a prefix, a branch, a copy)."""
    rows = []
    for parent, cut, suffix, _ in spec:
        base = rows[parent % len(rows)][:cut] if rows else []
        row = base + suffix
        rows.append(row or [1])
    return rows


def _masks(rows, spec):
    return [[bool((j * 7 + k + seed) % 3) for j in range(len(r))] for k, (r, (_, _, _, seed)) in enumerate(zip(rows, spec))]


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


def _check(rows, trained, budgets=(None,), modes=("keep",)):
    model = _MODEL
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


def test_tokens_computed_is_the_number_of_distinct_prefixes():
    spec_rows = [[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 5], [7, 8], [1, 2, 3], [1, 2, 3, 4], [7]]
    tree = sp.Tree.from_rows(spec_rows)
    distinct = len({tuple(r[: k + 1]) for r in spec_rows for k in range(len(r))})
    for budget in (None, 6, 2, 1):
        p = sp.plan(tree, budget)
        assert p.tokens_computed == distinct
        assert p.plain_tokens == sum(len(r) for r in spec_rows)
        assert all(budget is None or p.pass_tokens(s) <= budget for s in p.passes)
        reported = sorted(r for s in p.passes for r in s.rows)
        assert reported == list(range(len(spec_rows)))  # every row reported exactly once
    res = sp.backward(_MODEL, tree, lambda b: b.logprobs.sum(), max_tokens=3)
    assert res.tokens_computed == distinct and res.tokens_plain == sum(len(r) for r in spec_rows)


def test_bad_rows_and_masks_are_refused_naming_the_row():
    with pytest.raises(ValueError, match=r"rows\[1\] is empty"):
        sp.Tree.from_rows([[1, 2], []])
    with pytest.raises(ValueError, match=r"trained\[0\] has 3 entries but its row has 2 tokens"):
        sp.Tree.from_rows([[1, 2]], [[True, True, False]])
    with pytest.raises(ValueError, match="trained has 1 masks for 2 rows"):
        sp.Tree.from_rows([[1, 2], [3]], [[True, True]])
    with pytest.raises(TypeError, match="expected a bool tensor"):
        sp.Tree.from_rows([torch.tensor([1, 2])], [torch.tensor([1, 1])])
    with pytest.raises(ValueError, match=r"rows\[0\] holds token id 500, outside the model's vocabulary"):
        sp.logprobs(_MODEL, sp.Tree.from_rows([[1, 500]]))


def test_shard_a_tree_keeps_shared_rows_together():
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9, p, c] for p in (10, 11) for c in range(4)] + [[50, 51, 52, c] for c in range(4)]
    tree = sp.Tree.from_rows(rows)
    shards = [sp.shard_groups(tree, r, 2) for r in range(2)]
    assert sorted(i for s in shards for i in s.index) == list(range(len(rows)))  # every row exactly once
    assert all(len(s) > 0 for s in shards)
    for s in shards:
        assert all(torch.equal(s.rows[k], torch.tensor(rows[i])) for k, i in enumerate(s.index))
    # each rank holds one contiguous run of the rows in trie order, so shared prefixes stay together
    owners = {i: r for r, s in enumerate(shards) for i in s.index}
    in_trie_order = [owners[i] for i in sorted(range(len(rows)), key=lambda i: rows[i])]
    assert in_trie_order == sorted(in_trie_order)
