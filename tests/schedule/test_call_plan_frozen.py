"""A ``CallPlan`` is frozen when ``sp.plan_call`` makes it: it plans its own copy of the groups (token ids and
``prompt_inputs``) or tree, so that an in-place edit of the caller's tensors reaches none of its calls (the plan
followed an edit made before its first call: 1.9e-2 away from the values of the groups it was made from), and
nothing in it is an inference tensor, so that a first call under ``torch.inference_mode()`` (reference log-probs)
leaves it usable by ``sp.backward`` and grad-enabled log-probs (which crashed: "Inference tensors cannot be saved
for backward"), and the reverse. Compared in float64 with one plain forward per row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sharedprefix as sp
from tests.helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model

BUDGET = 24  # splits the first group: its prompt cached, its completions in later passes


def _groups():
    return random_groups(0, 3, [20, 7, 15], [[5, 3, 8], [4], [6, 2]])


def _edit(groups) -> None:
    """Change a prompt token and a completion token in place, the tensors the groups hold."""
    groups[0].prompt[3] = (groups[0].prompt[3] + 1) % 97
    groups[1].completions[0][1] = (groups[1].completions[0][1] + 1) % 97


def _weights(shape) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through dataclass fields, attributes, dicts and sequences."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool, torch.device, torch.dtype)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)] + list(getattr(obj, "__dict__", {}).values())
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in _tensors(x, seen)]


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _assert_frozen(cp: sp.CallPlan, callers) -> None:
    """No inference tensor in ``cp`` (its packed rows and their index tensors included), and none that shares
    storage with the caller's ``callers`` (their groups or tree)."""
    mine = _tensors(cp)
    assert len(mine) > 10 and cp.rows.built  # the walk reaches the packed rows
    assert not [t for t in mine if t.is_inference()]
    assert not _storages(mine) & _storages(_tensors(callers))


@pytest.mark.parametrize("first", [False, True], ids=["edit_before_first_call", "edit_after_first_call"])
def test_an_edit_of_the_groups_after_plan_call_reaches_no_call(first):
    model = tiny_model()
    groups = _groups()
    want = plain_logprobs(model, groups)[0].detach()
    w = _weights(want.shape)
    want_grads = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum())
    cp = sp.plan_call(model, groups, max_tokens=BUDGET)
    if first:
        with torch.no_grad():
            sp.logprobs(model, cp)
    _edit(groups)
    edited = plain_logprobs(model, groups)[0].detach()
    assert (edited - want).abs().max() > 1e-3  # the edit changes the values: the check below can fail
    with torch.no_grad():
        got = sp.logprobs(model, cp).logprobs
    assert (got - want).abs().max() <= 1e-9
    got_grads = grads_of(model, lambda: sp.backward(model, cp, lambda b: (b.logprobs * w[b.index]).sum()) and None)
    assert_grads_close(got_grads, want_grads, 1e-9)
    _assert_frozen(cp, groups)


def test_an_edit_of_a_tree_after_plan_call_reaches_no_call():
    model = tiny_model()
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 5, 6, 7]]
    tree = sp.Tree.from_rows(rows)
    cp = sp.plan_call(model, tree, max_tokens=8)
    with torch.no_grad():
        want = sp.logprobs(model, sp.Tree.from_rows(rows)).logprobs
        tree.rows[0][2] = 11
        tree.trained[1][3] = False
        assert not torch.equal(sp.logprobs(model, tree).logprobs, want)  # the edit changes the values
        assert torch.equal(sp.logprobs(model, cp).logprobs, want)
    _assert_frozen(cp, tree)


def test_an_edit_of_prompt_inputs_after_plan_call_reaches_no_call():
    from tests.support.vl import MROPE_GROUPS, mrope_model, plain_mrope

    model = mrope_model("qwen2_vl")
    groups = MROPE_GROUPS()
    want = plain_mrope(model, groups).detach()
    cp = sp.plan_call(model, groups)
    groups[0].prompt_inputs["pixel_values"].mul_(-2.0)
    with torch.no_grad():
        assert (plain_mrope(model, groups) - want).abs().max() > 1e-3  # the edit changes the values
        assert (sp.logprobs(model, cp).logprobs - want).abs().max() <= 1e-9
    _assert_frozen(cp, groups)


def test_a_deferred_call_backpropagates_the_groups_it_computed():
    """Without a plan too: deferred log-probs (values now, their backward later) planned a view of the caller's
    groups, so an edit between the call and the backward gave the gradient of other groups than the values'."""
    model = tiny_model()
    groups = _groups()
    w = _weights(plain_logprobs(model, groups)[0].shape)
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum())

    def deferred_then_edit():
        loss = (sp.logprobs(model, groups, max_tokens=BUDGET, defer=True).logprobs * w).sum()
        _edit(groups)
        return loss

    assert_grads_close(grads_of(model, deferred_then_edit), want, 1e-9)


@pytest.mark.parametrize("order", ["inference_first", "grad_first", "planned_in_inference_mode"])
def test_a_plan_serves_calls_with_and_without_grad_whatever_ran_first(order):
    """The measured case: reference log-probs under ``torch.inference_mode()`` on a fresh plan, then ``sp.backward``
    on it, crashed (its rows, packed at first use, were inference tensors)."""
    model = tiny_model()
    groups = _groups()
    want = plain_logprobs(model, groups)[0].detach()
    w = _weights(want.shape)
    want_grads = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum())
    if order == "planned_in_inference_mode":
        with torch.inference_mode():
            cp = sp.plan_call(model, groups, max_tokens=BUDGET)
    else:
        cp = sp.plan_call(model, groups, max_tokens=BUDGET)

    def inference():
        with torch.inference_mode():
            got = sp.logprobs(model, cp).logprobs
        assert (got - want).abs().max() <= 1e-9

    def with_grad():
        loss_fn = lambda b: (b.logprobs * w[b.index]).sum()  # noqa: E731
        assert_grads_close(grads_of(model, lambda: sp.backward(model, cp, loss_fn) and None), want_grads, 1e-9)
        for defer in (False, True):
            lp = lambda d=defer: (sp.logprobs(model, cp, defer=d).logprobs * w).sum()  # noqa: E731
            assert_grads_close(grads_of(model, lp), want_grads, 1e-9)

    for step in (with_grad, inference) if order == "grad_first" else (inference, with_grad):
        step()
    _assert_frozen(cp, groups)
