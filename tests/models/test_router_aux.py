"""The MoE load-balancing loss (``output_router_logits=True``) as the plain run computes it.

The plain run: one forward of every ``[prompt + completion]`` row, padding masked out, whose ``aux_loss`` counts
each prompt token once per completion. transformers computes the loss in float32 in any model, so it is compared
to a relative 1e-6 and its gradients to 1e-5 (the log-probs stay at float64's 1e-9).
"""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups
from sharedprefix.model import router
from sharedprefix.tools.zoo.checks import plain_aux_loss
from sharedprefix.tools.zoo.configs import build


@pytest.fixture(scope="module")
def model():
    m, _ = build("mixtral+router_aux_loss")
    assert m.config.output_router_logits
    return m


def _groups():
    return random_groups(0, 2, (9, 5), ((5, 3, 6), (4, 1)), vocab=97)


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).abs() / b.detach().double().abs())


@pytest.mark.parametrize("budget", [None, 12, 7])
def test_aux_loss_and_its_gradient_match_one_plain_forward_of_all_rows(model, budget):
    groups = _groups()
    if budget is not None:  # the budget splits the first group: its prompt runs in an earlier pass
        assert any(isinstance(s, sp.schedule.PrefixBackward) for s in sp.plan(groups, budget).steps)
    want_aux = plain_aux_loss(model, groups)
    out = sp.logprobs(model, groups, max_tokens=budget)
    assert out.aux_loss.dtype == want_aux.dtype and _rel(out.aux_loss, want_aux) <= 1e-6
    assert (out.logprobs - plain_logprobs(model, groups)[0]).abs().max() <= 1e-9
    w = torch.randn(out.logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum() + 3.0 * plain_aux_loss(model, groups))
    got = grads_of(model, lambda: (lambda o: (o.logprobs * w).sum() + 3.0 * o.aux_loss)(sp.logprobs(model, groups, max_tokens=budget)))
    assert any("gate" in n for n in got)  # the router is trained through the loss
    assert_grads_close(got, want, 1e-5)


def test_prompt_tokens_count_once_per_completion(model, monkeypatch):
    """Counting each prompt token once (the packed row as it is) gives another loss: the check above can fail."""
    groups = _groups()
    want = plain_aux_loss(model, groups)
    own = router.multiplicity
    monkeypatch.setattr(router, "multiplicity", lambda layout: torch.ones_like(own(layout)))
    with torch.no_grad():
        assert _rel(sp.logprobs(model, groups).aux_loss, want) > 1e-4


def test_multiplicities_of_a_tree_count_the_rows_through_each_segment(model):
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6, 11], [12, 13]]
    tree = sp.Tree.from_rows(rows)
    with torch.no_grad():
        out = sp.logprobs(model, tree)
    groups = [sp.Group(torch.tensor(r[:1]), [torch.tensor(r[1:])]) for r in rows]  # the same rows, nothing shared
    assert _rel(out.aux_loss, plain_aux_loss(model, groups)) <= 1e-6


def test_backward_refuses_the_aux_loss_with_the_fix(model):
    with pytest.raises(
        ValueError,
        match=r"output_router_logits=True, and sharedprefix.backward takes its loss per pass"
        r".*product of two means.*\.aux_loss",
    ):
        sp.backward(model, _groups(), lambda b: b.logprobs.sum())
    with pytest.raises(ValueError, match=r"logprobs defers its backward .*defer=True"):
        sp.logprobs(model, _groups(), defer=True)


def test_a_model_without_a_load_balancing_loss_is_refused_when_asked_for_one():
    m, _ = build("deepseek_v3")
    m.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"finds no load_balancing_loss_func"), torch.no_grad():
        sp.logprobs(m, _groups())
