import pytest

import sharedprefix as sp
from helpers import random_groups


def test_whole_groups_pack_first_fit_and_split_groups_reuse_prompt():
    groups = random_groups(0, 3, [10, 4, 30], [[5, 5], [3, 3], [8, 8, 8, 8]])
    p = sp.plan(groups, 24)
    whole = [s for s in p.passes if not s.record and any(p.tree.segments[x].completion is None for x in s.segments)]
    assert len(whole) == 2  # groups 0 (20 tokens) and 1 (10 tokens) do not fit one pass together: 30 > 24
    chunks = [s for s in p.passes if s.record]
    assert [p.pass_tokens(s) for s in chunks] == [24, 6]  # group 2's prompt of 30 as a chain of 24 + 6
    comp = [p.pass_tokens(s) for s in p.passes if not s.record and s not in whole]
    assert comp == [16, 16]  # 4 x 8 tokens need 2 passes under 24; balanced, not 24 + 8
    assert p.tokens_computed == 20 + 10 + 30 + 32
    assert p.plain_tokens == (15 * 2) + (7 * 2) + (38 * 4)
    text = p.describe()
    assert "prompt backward of group 2" in text and "tokens computed" in text


def test_every_completion_computed_exactly_once():
    groups = random_groups(0, 4, [3, 50, 7, 12], [[2] * 5, [9, 1, 4], [6], [3, 3, 3]])
    for budget in (None, 100, 20, 9):
        p = sp.plan(groups, budget)
        seen = [
            p.tree.segments[s].completion
            for st in p.passes
            for s in st.segments
            if p.tree.segments[s].completion is not None
        ]
        assert sorted(seen) == list(range(p.tree.num_completions))
        assert all(budget is None or p.pass_tokens(st) <= budget for st in p.passes)


def test_no_budget_plans_one_pass():
    groups = random_groups(0, 2, [3, 5], [[2], [1, 1]])
    assert len(sp.plan(groups).passes) == 1


def test_a_completion_over_the_budget_is_refused_with_the_budget_to_set():
    groups = random_groups(0, 1, [3], [[9]])
    with pytest.raises(ValueError, match="Set max_tokens >= 9"):
        sp.plan(groups, 8)


def test_completion_passes_are_balanced_and_minimal():
    from sharedprefix.schedule.planner import _balanced_rows

    lens = [256] * 32
    rows = _balanced_rows(list(range(32)), lens, 6144)
    assert [len(r) for r in rows] == [16, 16]
    lens = [5, 1, 7, 3, 3, 9, 2]
    rows = _balanced_rows(list(range(7)), lens, 12)
    sizes = [sum(lens[i] for i in r) for r in rows]
    # in order, greedy under 12 gives rows of 6, 10, 12, 2; balanced keeps 4 rows but caps them at 11
    assert len(rows) == 4 and [i for r in rows for i in r] == list(range(7))
    assert sizes == [6, 10, 3, 11]


def test_fsdp_order_is_a_transformation_of_the_plan():
    from sharedprefix.schedule.planner import Dummy, Pass, PrefixBackward

    groups = random_groups(0, 3, [10, 4, 30], [[5, 5], [3, 3], [8, 8, 8, 8]])
    p = sp.plan(groups, 24)
    n_f, n_fb = p.fsdp_rounds
    assert (n_f, n_fb) == (2, 2 + 2 + 2)  # 2 prompt chunks recorded; 2 whole + 2 completion passes + 2 backwards
    f = p.for_fsdp(n_f + 1, n_fb + 2)
    kinds = [
        "R"
        if isinstance(s, Pass) and s.record
        else "D"
        if isinstance(s, Dummy)
        else "B"
        if isinstance(s, PrefixBackward)
        else "P"
        for s in f.steps
    ]
    assert kinds == ["R", "R", "D", "P", "P", "P", "P", "B", "B", "D", "D"]
    assert [s.backward for s in f.steps if isinstance(s, Dummy)] == [False, True, True]
    text = f.describe()
    assert text.count("dummy 2-token") == 3 and "prompt backward of group 2" in text
    with pytest.raises(ValueError, match="below this plan's"):
        p.for_fsdp(n_f - 1, n_fb)
