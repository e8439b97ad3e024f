"""Gated delta-nets that hold their delta rule on the instance, as transformers 5.10 builds them (verl's
transformers): ``self.chunk_gated_delta_rule = ... or torch_chunk_gated_delta_rule``, called by the forward as
``self.chunk_gated_delta_rule(...)``. ``model.mixers.active`` wraps that instance attribute for the duration of a call.

This environment's transformers calls the module function by name, so ``bind_as_5_10`` simulates the 5.10 layout on
a copy of a tiny Qwen3-Next / Qwen3.5: each delta-net holds the module's function, and its forward reaches the delta
rule only through ``self.chunk_gated_delta_rule`` (the module name points at the instance's attribute while that
forward runs). Float64 exactness (log-probs 1e-9, gradients relative 1e-9 against one plain forward per row, under
``Float64Inside``), also under gradient checkpointing (each decoder layer's forward runs under ``Float64Inside``, so
that the recompute in backward is float64 too); the attribute restored after a call and after a call that raises;
a forward that bypasses its instance attribute is refused by the seams-reached check; another function held there
(a kernel package's) is refused.
"""

import copy
import functools
import sys

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.model import mixers
from sharedprefix.model.mixers import seams
from sharedprefix.tools.reference import Float64Inside
from support.hybrid import groups_of, model_of, zoo_model

ATTR = "chunk_gated_delta_rule"
FAMILIES = ["qwen3_next", "qwen3_5_text"]


def bind_as_5_10(monkeypatch, family, bypass=False):
    """A copy of the family's tiny float64 model in the 5.10 layout; returns (model, delta-nets, module function).
    ``bypass``: the forward calls the function it was built with, not its instance attribute (a control)."""
    model = copy.deepcopy(model_of(family) if family == "qwen3_next" else zoo_model(family))
    nets = [m for m, kinds in mixers.mixer_modules(model) if "delta" in kinds]
    cls = type(nets[0])
    src = sys.modules[cls.__module__]
    own = src.torch_chunk_gated_delta_rule
    for m in nets:  # bound when built: a plain attribute in 5.10. With the kernels package (a dependency since
        vars(m)[ATTR] = own  # 5.25) the module's function is an nn.Module, which ``m.attr = own`` would register
    forward = cls.forward

    def forward_5_10(self, *args, **kwargs):  # the 5.10 forward: the delta rule through the instance only
        saved = src.torch_chunk_gated_delta_rule
        src.torch_chunk_gated_delta_rule = own if bypass else self.chunk_gated_delta_rule
        try:
            return forward(self, *args, **kwargs)
        finally:
            src.torch_chunk_gated_delta_rule = saved

    monkeypatch.setattr(cls, "forward", forward_5_10)
    return model, nets, own


def _loss(w):
    return lambda b: (b.logprobs * w[b.index]).sum()


def _reference(model, gs):
    with Float64Inside():
        ref = plain_logprobs(model, gs)[0].detach()
        w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        want = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    return ref, w, want


def _assert_restored(model, nets, own):
    src = sys.modules[type(nets[0]).__module__]
    assert src.torch_chunk_gated_delta_rule is own
    assert all(vars(m)[ATTR] is own for m in nets)
    assert not seams._INSTALLED and not seams._ACTIVE


@pytest.mark.parametrize("family", FAMILIES)
def test_instance_bound_delta_rule_matches_plain_rows(monkeypatch, family):
    """One pass and a budget that cuts the 9-token prompt into a chain and splits its completions (keep and
    recompute): float64 log-probs and gradients equal to the plain rows; the attribute is the original afterwards."""
    model, nets, own = bind_as_5_10(monkeypatch, family)
    gs = groups_of()
    assert sp.plan(gs, 6).splits
    ref, w, want = _reference(model, gs)
    with Float64Inside():
        for budget, mode in [(None, "keep"), (6, "keep"), (6, "recompute")]:
            with torch.no_grad():
                out = sp.logprobs(model, gs, max_tokens=budget)
            assert float((out.logprobs - ref).abs().max()) <= 1e-9, (budget, mode)
            got = grads_of(
                model,
                lambda b=budget, m=mode: sp.backward(model, gs, _loss(w), max_tokens=b, prefix_activations=m) and None,
            )
            assert_grads_close(got, want, 1e-9)
            _assert_restored(model, nets, own)


def _inside(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with Float64Inside():
            return fn(*args, **kwargs)

    return run


def _float64_checkpoints(model):
    """Each decoder layer's checkpointed function under ``Float64Inside``: the recompute (inside autograd's backward,
    where an outer mode does not reach) is float64 as the first forward; and the decoder's forward, which a deferred
    ``sp.logprobs`` runs inside the backward (its rotary embedding casts to float32)."""
    model.model.forward = _inside(model.model.forward)
    for layer in model.model.layers:
        ckpt = layer._gradient_checkpointing_func  # partial(checkpoint, use_reentrant=False), which sharedprefix reads
        layer._gradient_checkpointing_func = functools.partial(_checkpoint_inside, ckpt.func, **ckpt.keywords)


def _checkpoint_inside(checkpoint, fn, *args, **kwargs):
    return checkpoint(_inside(fn), *args, **kwargs)


@pytest.mark.parametrize("family", [pytest.param("qwen3_next", marks=pytest.mark.slow), "qwen3_5_text"])  # (40 s, 20 s)
def test_instance_bound_delta_rule_under_gradient_checkpointing(monkeypatch, family):
    """Non-reentrant checkpointing: the delta rule recomputed in backward reaches the wrapped attribute (a recompute
    through the original would be refused by the seams-reached check); ``sp.backward`` whole and split, and
    grad-enabled ``sp.logprobs`` (deferred), give the plain rows' float64 gradient."""
    model, nets, own = bind_as_5_10(monkeypatch, family)
    gs = groups_of()
    _, w, want = _reference(model, gs)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _float64_checkpoints(model)
    seen = []
    wrapped = seams.seam_wrapper

    def counting(kind, fn):  # the recomputes pass through the wrapper: mark its calls inside autograd's backward
        seam = wrapped(kind, fn)

        def call(*a, **k):
            seen.append(kind.name == "delta" and torch._C._current_graph_task_id() >= 0)
            return seam(*a, **k)

        return call

    monkeypatch.setattr(seams, "seam_wrapper", counting)
    with Float64Inside():
        for budget in (None, 6):
            seen.clear()
            got = grads_of(model, lambda b=budget: sp.backward(model, gs, _loss(w), max_tokens=b) and None)
            assert_grads_close(got, want, 1e-9)
            assert any(seen) and not all(seen)  # first forwards, and recomputes inside backward
        got = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6).logprobs * w).sum())
        assert_grads_close(got, want, 1e-9)
    _assert_restored(model, nets, own)


def test_instance_attribute_restored_after_a_call_that_raises(monkeypatch):
    """Inside the call the instance holds the wrapper around the module's function; after a loss that raises (in the
    middle of the rounds) it holds the original again, and the module function too."""
    model, nets, own = bind_as_5_10(monkeypatch, "qwen3_next")
    during = []

    def loss(b):
        during.extend(vars(m)[ATTR] for m in nets)
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        sp.backward(model, groups_of(), loss, max_tokens=6)
    assert during and all(f is not own and f.__wrapped__ is own for f in during)
    _assert_restored(model, nets, own)


def test_control_a_forward_that_bypasses_its_attribute_is_refused(monkeypatch):
    """The same forward calling the function it was built with (what 5.10 does if the instance attribute is not
    wrapped) never reaches the seam: refused by the seams-reached check, not run as a wrong row."""
    model, _, _ = bind_as_5_10(monkeypatch, "qwen3_next", bypass=True)
    with pytest.raises(
        ValueError, match=r"Qwen3NextGatedDeltaNet ran its forward without calling \['torch_chunk_gated_delta_rule'\]"
    ):
        sp.logprobs(model, groups_of())


def test_another_function_bound_on_the_instance_is_refused(monkeypatch):
    """A delta-net holding a function other than the module's (5.10 binds flash-linear-attention's kernel when the
    package is installed) is refused when checked, naming the attribute and the function."""
    model, nets, own = bind_as_5_10(monkeypatch, "qwen3_next")

    def chunk_gated_delta_rule(*args, **kwargs):  # stands in for a kernel package's function
        return own(*args, **kwargs)

    vars(nets[0])[ATTR] = chunk_gated_delta_rule  # the attribute is a plain one (see ``bind_as_5_10``)
    with pytest.raises(
        ValueError, match=r"Qwen3NextGatedDeltaNet holds 'chunk_gated_delta_rule' = .*chunk_gated_delta_rule, bound"
    ):
        sp.logprobs(model, groups_of())
