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
    got = grads_of(
        model,
        lambda: (lambda o: (o.logprobs * w).sum() + 3.0 * o.aux_loss)(sp.logprobs(model, groups, max_tokens=budget)),
    )
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


def _backward_grads(model, groups, w, budget, mode, coef):
    res = []
    grads = grads_of(
        model,
        lambda: res.append(
            sp.backward(
                model,
                groups,
                lambda b: (b.logprobs * w[b.index]).sum(),
                max_tokens=budget,
                prefix_activations=mode,
                aux_loss_coef=coef,
            )
        ),
    )
    return grads, res[0]


@pytest.mark.parametrize("budget, mode", [(None, "keep"), (12, "keep"), (7, "offload"), (7, "recompute")])
def test_backward_carries_the_aux_loss_exactly_under_any_budget(model, budget, mode):
    """sp.backward(aux_loss_coef=c): the gradient of sum(w * logprobs) + c * aux of one plain forward of all rows.
    The aux part is compared to a relative 1e-5 (transformers' loss is float32 inside, in a float64 model too; the
    plain run's own rounding is 3e-7 here), the log-prob part and every budget against the unsplit call to 1e-9."""
    groups = _groups()
    if budget is not None:
        assert sp.plan(groups, budget).splits
    ref = plain_logprobs(model, groups)[0]
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum() + 3.0 * plain_aux_loss(model, groups))
    got, res = _backward_grads(model, groups, w, budget, mode, 3.0)
    assert_grads_close(got, want, 1e-5)
    assert abs(res.aux_loss - float(plain_aux_loss(model, groups).detach())) <= 1e-6 * abs(res.aux_loss)
    no_aux, res0 = _backward_grads(model, groups, w, budget, mode, 0.0)
    assert res0.aux_loss is None and abs(res.loss - res0.loss - 3.0 * res.aux_loss) <= 1e-9 * abs(res.loss)
    want_aux = grads_of(model, lambda: 3.0 * plain_aux_loss(model, groups))  # the layers below the last router
    aux_part = {n: got[n] - no_aux[n] for n in want_aux}
    assert_grads_close(aux_part, want_aux, 1e-5)  # the aux term itself, not hidden by the log-prob part
    unsplit, _ = _backward_grads(model, groups, w, None, "keep", 3.0)
    assert_grads_close(got, unsplit, 1e-9)  # budgets and modes change nothing


def test_backward_with_aux_loss_counts_prompt_tokens_once_per_completion(model, monkeypatch):
    """The check above can fail: multiplicities of one (the packed row as it is) move the aux gradient by > 1e-3."""
    groups = _groups()
    w = torch.zeros(plain_logprobs(model, groups)[0].shape, dtype=torch.float64)
    want = grads_of(model, lambda: 3.0 * plain_aux_loss(model, groups))
    own = router.multiplicity
    monkeypatch.setattr(router, "multiplicity", lambda layout: torch.ones_like(own(layout)))
    got, _ = _backward_grads(model, groups, w, 7, "keep", 3.0)
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close({n: got[n] for n in want}, want, 1e-3)


def test_deferred_logprobs_carry_the_aux_loss_gradient(model):
    """sp.logprobs(defer=True) (TRL's path under a budget or gradient checkpointing): .aux_loss's gradient reaches
    the parameters through the deferred sp.backward, as the undeferred call's graph does."""
    groups = _groups()
    w = torch.randn(
        plain_logprobs(model, groups)[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )

    def loss(defer, budget):
        o = sp.logprobs(model, groups, max_tokens=budget, defer=defer)
        return (o.logprobs * w).sum() + 3.0 * o.aux_loss

    want = grads_of(model, lambda: loss(False, None))
    deferred = grads_of(model, lambda: loss(True, None))
    # the undeferred graph and the linear term both differentiate transformers' float32-inside loss: 2.5e-8 apart
    assert_grads_close(deferred, want, 1e-6)
    assert_grads_close(grads_of(model, lambda: loss(True, 7)), deferred, 1e-9)


def test_backward_asks_for_the_coefficient_when_the_config_turns_the_loss_on(model):
    with pytest.raises(ValueError, match=r"output_router_logits=True.*aux_loss_coef is None.*aux_loss_coef=0.0"):
        sp.backward(model, _groups(), lambda b: b.logprobs.sum())
    with pytest.raises(TypeError, match=r"aux_loss_coef='0.1'"):
        sp.backward(model, _groups(), lambda b: b.logprobs.sum(), aux_loss_coef="0.1")
    # following the advice: 0.0 leaves the loss out, and the call runs
    assert sp.backward(model, _groups(), lambda b: b.logprobs.sum(), aux_loss_coef=0.0).aux_loss is None


def test_aux_loss_on_request_where_the_config_has_it_off():
    """TRL asks for the loss whenever the config has the attribute (output_router_logits=False included)."""
    m, _ = build("mixtral+router_aux_loss")
    m.config.output_router_logits = False
    groups = _groups()
    with torch.no_grad():
        assert sp.logprobs(m, groups).aux_loss is None
        out = sp.logprobs(m, groups, aux_loss=True)
    assert not m.config.output_router_logits  # restored after the call
    m.config.output_router_logits = True
    assert _rel(out.aux_loss, plain_aux_loss(m, groups)) <= 1e-6


def test_a_model_without_a_load_balancing_loss_is_refused_when_asked_for_one():
    m, _ = build("deepseek_v3")
    m.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"finds no load_balancing_loss_func"), torch.no_grad():
        sp.logprobs(m, _groups())


def test_reentrant_checkpointing_loses_the_aux_gradient_so_training_it_is_refused():
    """Found by ``tests/invariant/test_fuzz.py``: under gradient checkpointing with use_reentrant=True, transformers
    records the router logits inside the checkpointed layers, which run without grad, so the plain forward's
    ``aux_loss`` has no gradient and sharedprefix's linear terms had a wrong one (a silent 1e-2 mismatch of
    embed_tokens' gradient). Every call that trains the loss is refused before touching a gradient; without the loss,
    or with non-reentrant checkpointing, the calls run."""
    m, _ = build("mixtral+router_aux_loss")
    groups = _groups()
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    plain = m(input_ids=torch.cat([groups[0].prompt, groups[0].completions[0]])[None], use_cache=False)
    assert not plain.aux_loss.requires_grad  # the control: transformers' own loss lost its gradient
    match = "use_reentrant=True, and this call trains its MoE load-balancing loss"
    with pytest.raises(ValueError, match=match):
        sp.backward(m, groups, lambda b: b.logprobs.sum(), aux_loss_coef=0.5)
    with pytest.raises(ValueError, match=match):
        sp.logprobs(m, groups)
    assert all(p.grad is None for p in m.parameters())
    with torch.no_grad():  # no gradient asked for: the value is fine
        assert sp.logprobs(m, groups).aux_loss is not None
    sp.backward(m, groups, lambda b: b.logprobs.sum(), aux_loss_coef=0.0)  # the loss left out
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    w = torch.randn(plain_logprobs(m, groups)[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    m.gradient_checkpointing_disable()
    want = grads_of(m, lambda: (plain_logprobs(m, groups)[0] * w).sum() + 0.5 * plain_aux_loss(m, groups))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = grads_of(
        m, lambda: sp.backward(m, groups, lambda b: (b.logprobs * w[b.index]).sum(), aux_loss_coef=0.5) and None
    )
    assert_grads_close(got, want, 1e-5)
