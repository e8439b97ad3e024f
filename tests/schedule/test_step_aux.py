"""sp.plan_step with the MoE load-balancing loss: each microbatch's loss is the plain run's over its own rows (a shared
prompt's tokens counted once per row of that microbatch), and the gradient after the step the per-microbatch runs'
summed, for sp.backward (aux_loss_coef), deferred log-probs and log-probs that keep their graph, under budgets and every
prefix mode. The layout: a prompt whose rows span three microbatches, a microbatch whose rows hold two prompts.

transformers computes the loss in float32 in any model (and a float64 Mixtral routes in float32), so against the plain
transformers run of each microbatch the gradient is held to a relative 1e-5, as ``tests/model/test_router_aux.py``
holds one call's; the step itself is held to float64's 1e-9 against ``sp.backward`` of each microbatch's rows as its
own call (the exact mechanism of one call) with the model computing in float64 outside the loss function
(``Float64Inside``), where its plain run without the loss agrees to 1e-15; log-probs' backward runs outside that
mode (``_check``)."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.schedule import step_aux
from sharedprefix.tools.zoo.checks import plain_aux_loss
from sharedprefix.tools.zoo.configs import build
from support.moe_step import COEF, loss, microbatches, mixtral_float64_outside_the_loss
from support.schedule import MODES, microbatch_weights


@pytest.fixture(scope="module")
def model():
    """A float64 Mixtral with output_router_logits=True computing in float64 outside its loss function."""
    with mixtral_float64_outside_the_loss() as m:
        yield m


def _plain(model, mbs, Ws):
    """Each microbatch's plain transformers forward: sum(W * log-probs) + COEF * its own aux loss, summed."""
    return grads_of(
        model,
        lambda: sum(
            (plain_logprobs(model, mb)[0] * W).sum() + COEF * plain_aux_loss(model, mb) for mb, W in zip(mbs, Ws)
        ),
    )


def _calls(model, mbs, Ws, defer=None):
    """Each microbatch's rows as its own call (one call's exact mechanism), summed: ``sp.backward``, or with ``defer``
    ``sp.logprobs`` (deferred, or the graph kept) and the caller's backward."""
    model.zero_grad(set_to_none=True)
    for mb, W in zip(mbs, Ws):
        if defer is None:
            sp.backward(model, mb, loss(W), aux_loss_coef=COEF)
        else:
            out = sp.logprobs(model, mb, defer=defer)
            ((out.logprobs * W).sum() + COEF * out.aux_loss).backward()
    return _grads(model)


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _rel(a, b):
    a, b = (float(x.detach()) if isinstance(x, torch.Tensor) else x for x in (a, b))
    return abs(a - b) / abs(b)


def _check(model, mbs, Ws, got, defer=None):
    """Against each microbatch as its own call of the same kind: 1e-9 for sp.backward; 1e-6 for log-probs, whose
    backward (deferred, or the step's tail) autograd runs outside ``_Float64OutsideTheLoss``, so that the model routes
    in float32 there (measured: 1e-7 between one call's deferred log-probs and its sp.backward)."""
    assert any("gate" in n for n in got)  # the routers are trained through the loss
    assert_grads_close(got, _calls(model, mbs, Ws, defer), 1e-9 if defer is None else 1e-6)
    assert_grads_close(got, _plain(model, mbs, Ws), 1e-5)


@pytest.mark.slow  # Float64OutsideTheLoss: a torch function mode; the lighter siblings are the tests below
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [None, 12, 6])
def test_backward_of_a_step_carries_each_microbatchs_aux_loss(model, mode, budget):
    mbs = microbatches()
    Ws = microbatch_weights(mbs)
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode)
    assert step.splan.shared_tokens == 20 + 9  # both prompts are shared (each has rows in two or more microbatches)
    tokens = 0
    for k, W in enumerate(Ws):
        res = sp.backward(model, step.microbatch(k), loss(W), aux_loss_coef=COEF)
        assert _rel(res.aux_loss, plain_aux_loss(model, mbs[k])) <= 1e-6  # transformers' loss: float32 inside
        tokens += res.tokens_computed
    assert step.state == "finished" and len(step.cache.segments()) == 0
    _check(model, mbs, Ws, _grads(model))
    # each prompt once for the step (recompute runs the shared prompts' forward again at the end)
    prompts, completions = 20 + 9, 21 + 10
    assert tokens == prompts + completions + (prompts if mode == "recompute" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("defer", [True, False])
def test_logprobs_of_a_step_return_each_microbatchs_aux_loss(model, mode, defer):
    """TRL's way: grad-enabled log-probs per microbatch with .aux_loss in the caller's loss (deferred, or the graph
    kept), the prompts' backward at the last microbatch."""
    mbs = microbatches()
    Ws = microbatch_weights(mbs, seed=2)
    budget = 12 if defer else None  # (a graph kept needs each microbatch's own rows within the budget)
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode)
    for k, W in enumerate(Ws):
        out = sp.logprobs(model, step.microbatch(k), defer=defer)
        assert (out.logprobs.detach() - plain_logprobs(model, mbs[k])[0]).abs().max() <= 1e-9
        assert _rel(out.aux_loss.detach(), plain_aux_loss(model, mbs[k])) <= 1e-6
        ((out.logprobs * W).sum() + COEF * out.aux_loss).backward()
    assert step.state == "finished"
    _check(model, mbs, Ws, _grads(model), defer)


def test_aux_loss_alone_finishes_a_step_with_the_graph_kept(model):
    """A loss of .aux_loss alone backpropagates through the step's microbatch (its outputs carry the step's tail)."""
    mbs = microbatches()
    Ws = [torch.zeros_like(W) for W in microbatch_weights(mbs)]
    step = sp.plan_step(model, mbs)
    for k in range(len(mbs)):
        (COEF * sp.logprobs(model, step.microbatch(k), defer=False).aux_loss).backward()
    assert step.state == "finished"
    got = _grads(model)
    want = _calls(model, mbs, Ws, defer=False)
    for n in set(got) ^ set(want):  # (parameters one side's passes reach with a zero gradient)
        assert not (got[n] if n in got else want[n]).any()
    both = set(got) & set(want)
    assert_grads_close({n: got[n] for n in both}, {n: want[n] for n in both}, 1e-6)


def _step_error(model, mbs, Ws):
    step = sp.plan_step(model, mbs, max_tokens=12)
    for k, W in enumerate(Ws):
        sp.backward(model, step.microbatch(k), loss(W), aux_loss_coef=COEF)
    got, want = _grads(model), _plain(model, mbs, Ws)
    floor = 1e-6 * max(float(w.abs().max()) for w in want.values())
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(floor)) for n in want)


def test_shared_tokens_are_weighted_by_the_microbatchs_own_rows(model, monkeypatch):
    """The checks above can fail: the shared prompts weighted by every row of the step, not the microbatch's."""
    own = step_aux.records

    def whole_step(step, k, recs):
        n = float(len(step.splan.tree.rows))
        return [
            (z, torch.full_like(w, n), s) if s[0][0] in step.cache.routed else (z, w, s)
            for z, w, s in own(step, k, recs)
        ]

    monkeypatch.setattr(step_aux, "records", whole_step)
    mbs = microbatches()
    assert _step_error(model, mbs, microbatch_weights(mbs)) > 1e-3


def test_shared_aux_gradient_reaches_the_prompts(model, monkeypatch):
    """The checks above can fail: the shared prompts' share of the aux gradient never delivered."""
    monkeypatch.setattr(step_aux, "add_shared", lambda step, grads: None)
    mbs = microbatches()
    assert _step_error(model, mbs, microbatch_weights(mbs)) > 1e-3


def test_a_step_planned_without_the_loss_refuses_it():
    m, _ = build("mixtral")
    assert not m.config.output_router_logits
    mbs = microbatches()
    step = sp.plan_step(m, mbs)  # the config leaves the loss off: no router logits cached
    with pytest.raises(ValueError, match=r"aux_loss=True on microbatch 0 of a step planned without.*aux_loss=True"):
        sp.logprobs(m, step.microbatch(0), aux_loss=True)
    with pytest.raises(ValueError, match=r"aux_loss_coef=0.5 on microbatch 0 of a step planned without"):
        sp.backward(m, step.microbatch(0), lambda b: b.logprobs.sum(), aux_loss_coef=0.5)
    assert step.state == "planned"
    # following the advice: planned with aux_loss=True, the calls return each microbatch's loss
    step = sp.plan_step(m, mbs, aux_loss=True)
    for k in range(len(mbs)):
        out = sp.logprobs(m, step.microbatch(k))
        assert _rel(out.aux_loss.detach(), sp.logprobs(m, mbs[k], aux_loss=True).aux_loss.detach()) <= 1e-6
        (out.logprobs.sum() + 0.5 * out.aux_loss).backward()
    assert step.state == "finished"
