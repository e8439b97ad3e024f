"""Prefix trees: sp.logprobs / sp.backward on any rows against one plain forward per row, in float64."""

import pytest
import torch

import sharedprefix as sp
from helpers import tiny_model

_MODEL = tiny_model("qwen2", seed=3)


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
