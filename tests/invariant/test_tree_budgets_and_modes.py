"""Invariance over the schedule for prefix trees: any rows, every budget (down to splits at every depth) and
every ``prefix_activations`` mode give one plain forward per row, log-probs and gradients, in float64; a list of
groups and the same rows as a tree give the same numbers.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import tiny_model
from support.trees import ROW_SPEC, check_tree, masks, tree_rows

_MODEL = tiny_model("qwen2", seed=3)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=ROW_SPEC, budget=st.sampled_from([None, 2, 3, 5, 8]), mode=st.sampled_from(["keep", "offload", "recompute"])
)
def test_random_tries_match_plain_rows(spec, budget, mode):
    rows = tree_rows(spec)
    check_tree(_MODEL, rows, masks(rows, spec), budgets=(budget,), modes=(mode,))


def test_agentic_rows_match_plain_rows_under_budgets_that_split_every_depth():
    system = list(range(1, 13))
    rows = []
    for p in range(3):
        prompt = system + [20 + p] * (3 + p)
        for c in range(3):
            rows.append(prompt + [40 + c, 41 + p, 42])  # turn 1
        rows.append(prompt + [40, 41 + p, 42, 60, 61] + [70 + p])  # a second turn on top of a first
    rows.append(system[:5])  # a row that is a prefix of every other row
    rows.append(list(rows[0]))  # a duplicate row
    trained = [[t >= 12 for t in range(len(r))] for r in rows]
    trained[-2] = [True] * 5  # trained tokens inside the shared system prompt
    check_tree(_MODEL, rows, trained, budgets=(None, 30, 11, 4), modes=("keep", "recompute"))


def test_groups_and_their_rows_give_the_same_numbers():
    g = sp.Group([5, 6, 7], [[1, 2], [3], [1, 4, 4]])
    rows = [[5, 6, 7] + list(c.tolist()) for c in g.completions]
    trained = [[t >= 3 for t in range(len(r))] for r in rows]
    with torch.no_grad():
        by_group = sp.logprobs(_MODEL, [g])
        by_rows = sp.logprobs(_MODEL, sp.Tree.from_rows(rows, trained))
    assert (by_rows.logprobs[:, 3:] - by_group.logprobs).abs().max() <= 1e-12  # the trie also shares "1"
    assert torch.equal(by_rows.mask[:, 3:], by_group.mask) and not by_rows.mask[:, :3].any()
