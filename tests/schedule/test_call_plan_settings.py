"""A call on a ``CallPlan``: its own keywords always win, the default's value passed explicitly included; the keywords
it leaves out are the plan's (``sp.plan_call``'s). Left out and passed are told apart by the signature's ``Default``,
never by comparing with the default value (which ran ``temperature=1.0`` at the plan's 0.7, silently). The plan's
shaping settings (``max_tokens``, ``backend``, ``sequence_group``) passed with another value are refused, the default
included. DDP's ``sync`` and ``grad_reduction``: ``tests/parallel/test_plan_settings.py``."""

from __future__ import annotations

import inspect

import pytest
import torch

import sharedprefix as sp
from sharedprefix.schedule import call
from sharedprefix.schedule.options import Default
from tests.helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model

GROUPS = random_groups(0, 3, [20, 7, 15], [[5, 3, 8], [4], [6, 2]])
BUDGET = 24  # splits the first group: its prompt cached, its completions in later passes


def _weights(shape) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _far(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture
def seen(monkeypatch):
    """The ``CallOptions`` each public call resolved (``call.prepare``), in order."""
    got = []
    own = call.prepare

    def spy(*a, **k):
        out = own(*a, **k)
        got.append(out[0])
        return out

    monkeypatch.setattr(call, "prepare", spy)
    return got


# (keyword, the plan's value, the public default passed explicitly, what the call then runs under)
LOGPROBS = [
    ("temperature", 0.7, 1.0, 1.0),
    ("entropy", True, False, False),
    ("defer", True, None, None),
    ("prefix_activations", "keep", "recompute", "recompute"),
    ("grad_reduction", "mean", "sum", "sum"),
    ("aux_loss", False, None, None),
]
BACKWARD = [
    ("temperature", 0.7, 1.0, 1.0),
    ("entropy", True, False, False),
    ("prefix_activations", "offload", None, "keep"),  # None: the engine's default
    ("offload_device", "cuda:1", "cpu", "cpu"),
    ("sync", False, True, True),
    ("grad_reduction", "mean", "sum", "sum"),
]


def _run(fn, model, source, **kw):
    if fn == "logprobs":
        return sp.logprobs(model, source, **kw)  # grad enabled: defer decides the path
    return sp.backward(model, source, lambda b: b.logprobs.sum(), **kw)


@pytest.mark.parametrize(
    "fn, name, planned, explicit, runs",
    [("logprobs", *row) for row in LOGPROBS] + [("backward", *row) for row in BACKWARD],
)
def test_every_keyword_passed_at_its_default_wins_over_the_plan(fn, name, planned, explicit, runs, seen):
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=BUDGET, **{name: planned})
    _run(fn, model, cp, **{name: explicit})
    _run(fn, model, cp)  # the control: left out, the plan's
    assert getattr(seen[0], name) == runs and type(getattr(seen[0], name)) is type(runs)
    assert getattr(seen[1], name) == planned


def test_the_signatures_show_the_documented_defaults():
    """``help(sp.logprobs)`` reads ``temperature: float = 1.0``: the marker's repr is its value's."""
    for fn in (sp.logprobs, sp.backward):
        params = inspect.signature(fn).parameters
        assert "temperature: 'float' = 1.0" in str(inspect.signature(fn))
        marked = {k: p.default for k, p in params.items() if isinstance(p.default, Default)}
        assert {k for k, p in params.items() if p.default is not p.empty} - set(marked) <= {"aux_loss_coef"}
        assert all(repr(d) == repr(d.value) for d in marked.values())
    assert str(inspect.signature(sp.backward).parameters["prefix_activations"]).endswith("= None")


def test_temperature_passed_at_its_default_is_the_calls_not_the_plans():
    """The measured case: a plan made at 0.7, a call at 1.0 ran at 0.7 (6.3e-2 away); 1 (an int) was honoured."""
    model = tiny_model()
    at = {t: plain_logprobs(model, GROUPS, temperature=t)[0].detach() for t in (0.7, 1.0)}
    assert _far(at[0.7], at[1.0]) > 1e-2  # the two temperatures are told apart
    cp = sp.plan_call(model, GROUPS, max_tokens=BUDGET, temperature=0.7)
    with torch.no_grad():
        got = sp.logprobs(model, cp, temperature=1.0).logprobs
        assert _far(got, at[1.0]) <= 1e-9 and _far(got, at[0.7]) > 1e-2
        assert _far(sp.logprobs(model, cp).logprobs, at[0.7]) <= 1e-9  # left out: the plan's
    w = _weights(at[1.0].shape)
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS, temperature=1.0)[0] * w).sum())
    other = grads_of(model, lambda: (plain_logprobs(model, GROUPS, temperature=0.7)[0] * w).sum())
    for defer in (False, True):  # grad-enabled log-probs, on the graph and deferred
        got = grads_of(model, lambda d=defer: (sp.logprobs(model, cp, temperature=1.0, defer=d).logprobs * w).sum())
        assert_grads_close(got, want, 1e-9)
        with pytest.raises(AssertionError):
            assert_grads_close(got, other, 1e-3)
    loss_fn = lambda b: (b.logprobs * w[b.index]).sum()  # noqa: E731
    got = grads_of(model, lambda: sp.backward(model, cp, loss_fn, temperature=1.0) and None)
    assert_grads_close(got, want, 1e-9)
    with pytest.raises(AssertionError):
        assert_grads_close(got, other, 1e-3)


def test_entropy_false_is_the_calls_not_the_plans():
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=BUDGET, entropy=True)
    with torch.no_grad():
        assert sp.logprobs(model, cp, entropy=False).entropy is None
        assert sp.logprobs(model, cp).entropy is not None  # left out: the plan's
    got = []
    sp.backward(model, cp, lambda b: got.append(b.entropy) or b.logprobs.sum(), entropy=False)
    assert got and all(e is None for e in got)
    sp.backward(model, cp, lambda b: got.append(b.entropy) or b.logprobs.sum())
    assert got[-1] is not None


def test_defer_none_passed_after_a_plan_with_defer_false_follows_checkpointing():
    """The measured case: a plan made with defer=False, gradient checkpointing turned on, then a call with defer=None
    as the refusal advised: it was refused again, naming defer=False, which the call never passed."""
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=BUDGET, defer=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints in training mode only (the tiny models have no dropout)
    with pytest.raises(ValueError, match=r"the CallPlan's defer=False \(from sp.plan_call\) .* Pass defer=None"):
        sp.logprobs(model, cp)  # left out: the plan's, and named as the plan's
    w = _weights(plain_logprobs(model, GROUPS)[0].shape)
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
    out = sp.logprobs(model, cp, defer=None)
    assert type(out.logprobs.grad_fn).__name__ == "_DeferredBackward"
    got = grads_of(model, lambda: (sp.logprobs(model, cp, defer=None).logprobs * w).sum())
    assert_grads_close(got, want, 1e-9)


def test_defer_false_passed_after_a_plan_with_defer_true_runs_on_the_graph():
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=BUDGET, defer=True)
    assert type(sp.logprobs(model, cp).logprobs.grad_fn).__name__ == "_DeferredBackward"
    assert type(sp.logprobs(model, cp, defer=False).logprobs.grad_fn).__name__ != "_DeferredBackward"


def test_aux_loss_none_passed_after_a_plan_with_aux_loss_true_follows_the_config():
    from sharedprefix.tools.zoo.configs import build

    model, _ = build("mixtral+router_aux_loss")
    model.config.output_router_logits = False  # None: as the config says, here no loss
    groups = random_groups(0, 2, (9, 5), ((5, 3, 6), (4, 1)))
    cp = sp.plan_call(model, groups, aux_loss=True)
    with torch.no_grad():
        assert sp.logprobs(model, cp, aux_loss=None).aux_loss is None
        assert sp.logprobs(model, cp).aux_loss is not None  # left out: the plan's


@pytest.mark.parametrize(
    "planned, passed, match",
    [
        (
            dict(max_tokens=BUDGET),
            dict(max_tokens=None),
            r"max_tokens=None disagrees with the CallPlan's max_tokens=24",
        ),
        (dict(backend="reference"), dict(backend="auto"), r"backend='auto' disagrees with the CallPlan's backend='ref"),
    ],
)
def test_a_plan_shaping_setting_passed_at_its_default_is_refused(planned, passed, match):
    """A plan made with ``max_tokens=24`` ran a call's ``max_tokens=None`` under 24, silently."""
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, **planned)
    for run in (
        lambda: sp.logprobs(model, cp, **passed),
        lambda: sp.backward(model, cp, lambda b: b.logprobs.sum(), **passed),
    ):
        with pytest.raises(ValueError, match=match):
            run()
    with torch.no_grad():  # left out, or passed at the plan's value: the plan's
        assert torch.equal(sp.logprobs(model, cp).logprobs, sp.logprobs(model, cp, **planned).logprobs)
