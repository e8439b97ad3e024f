"""Invariance over the schedule: every token budget (one pass, groups split, one completion per pass, a prompt in
chunks), every ``prefix_activations`` mode and any group order give the plain per-row gradient, in float64.

Hypothesis draws random group layouts and budgets; the fixed cases cover three architectures and both CPU kernels.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import assert_grads_close, random_groups, tiny_model
from support.schedule import BUDGETS, MODES, SPEC, plain_reference, run_backward, weighted_loss

_MODEL = tiny_model("qwen2", seed=3)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
@pytest.mark.parametrize("mode", MODES)
def test_budgets_and_modes_match_plain_float64(arch, mode, kernel_path):
    model = tiny_model(arch)
    groups = random_groups(1, 3, *SPEC) if arch != "gpt2" else random_groups(1, 2, [12, 20], [[3, 4, 1, 5], [6, 2, 7]])
    n = sum(g.group_size for g in groups)
    W = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, want_loss = plain_reference(model, groups, W)
    budgets = BUDGETS if arch == "qwen3" else [None, 20, 7]
    for budget in budgets:
        res, got = run_backward(model, groups, weighted_loss(W), max_tokens=budget, prefix_activations=mode)
        assert math.isclose(res.loss, want_loss, rel_tol=1e-9), (budget, res.loss, want_loss)
        assert_grads_close(got, want, 1e-9)
        assert res.tokens_plain == sum(
            g.prompt.numel() * g.group_size + sum(c.numel() for c in g.completions) for g in groups
        )
        if mode == "offload" and budget is not None and budget < 35:
            assert res.offloaded_bytes > 0  # the saved-tensor hooks really moved the prompt's activations
        if mode == "recompute" and budget is not None and budget < 35:
            assert res.tokens_computed > sp.plan(groups, budget).tokens_computed  # prompts ran twice


def test_group_order_and_budget_leave_the_gradient_unchanged():
    model = tiny_model("qwen3")
    groups = random_groups(7, 3, *SPEC)
    n = sum(g.group_size for g in groups)
    W = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, base = run_backward(model, groups, weighted_loss(W), max_tokens=None)
    perm = [2, 0, 1]
    offsets = [0, 4, 5, 10]
    Wp = torch.cat([W[offsets[i] : offsets[i + 1]] for i in perm])
    for budget in (33, 8):
        _, got = run_backward(
            model, [groups[i] for i in perm], weighted_loss(Wp), max_tokens=budget, prefix_activations="recompute"
        )
        assert_grads_close(got, base, 1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 14), st.lists(st.integers(1, 6), min_size=1, max_size=5)), min_size=1, max_size=3
    ),
    budget=st.integers(6, 40),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 1000),
)
def test_random_layouts_budgets_and_modes_match_plain_float64(spec, budget, mode, seed):
    model = _MODEL
    groups = random_groups(seed, len(spec), [s[0] for s in spec], [s[1] for s in spec])
    n = sum(len(s[1]) for s in spec)
    W = torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    W = W[:, : max(max(s[1]) for s in spec)]
    want, want_loss = plain_reference(model, groups, W)
    res, got = run_backward(model, groups, weighted_loss(W), max_tokens=budget, prefix_activations=mode)
    assert math.isclose(res.loss, want_loss, rel_tol=1e-9, abs_tol=1e-12)
    assert_grads_close(got, want, 1e-9)
