"""accelerate's mixed precision: ``Accelerator(mixed_precision="bf16").prepare(model)`` replaces the model's
``forward`` with one that runs under ``torch.autocast`` (and converts the outputs to float32). sharedprefix runs the
decoder, not that forward, so each call applies the same autocast itself (``model.forward_mode.forward_autocast``): its
log-probs and gradients are within twice the plain bf16 run's error against float64 (the bf16 rule), where before
the head check compared the autocast forward with a float32 head and refused the model with a false reason."""

import pytest
import torch

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model
from sharedprefix.model import forward_mode

accelerate = pytest.importorskip("accelerate")

GROUPS = random_groups(3, 3, [14, 6, 9], [[3, 4, 5], [2], [4, 4]])


@pytest.fixture
def prepared():
    """(the float64 model, a float32 copy prepared by accelerate with bf16 mixed precision)."""
    from accelerate.state import AcceleratorState

    model64 = tiny_model()
    model = tiny_model(dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    yield model64, accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    AcceleratorState._reset_state(True)


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn()
    out = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _err(got, want):
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


def test_bf16_mixed_precision_follows_the_prepared_forward(prepared):
    model64, model = prepared
    found = forward_mode.forward_autocast(model)
    assert found is not None and found.fast_dtype == torch.bfloat16
    exact = plain_logprobs(model64, GROUPS)[0]
    W = torch.randn(exact.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * (exact != 0)
    with torch.no_grad():
        plain = plain_logprobs(model, GROUPS)[0].double()  # the prepared forward: bf16 autocast
        plain_err = float((plain - exact).abs().max())
        assert plain_err > 1e-4  # autocast is on in the plain run: bf16 rounding, not float32
        for kw in ({}, dict(max_tokens=12)):
            ours = sp.logprobs(model, GROUPS, **kw).logprobs.double()
            assert float((ours - exact).abs().max()) <= 2 * plain_err
    want = _grads(model64, lambda: (plain_logprobs(model64, GROUPS)[0] * W).sum().backward())
    plain_g = _err(_grads(model, lambda: (plain_logprobs(model, GROUPS)[0].double() * W).sum().backward()), want)
    loss = lambda b: (b.logprobs.double() * W[b.index, : b.logprobs.shape[1]]).sum()  # noqa: E731
    for mode in ("keep", "recompute"):
        ours_g = _err(
            _grads(model, lambda m=mode: sp.backward(model, GROUPS, loss, max_tokens=12, prefix_activations=m)), want
        )
        assert ours_g <= 2 * plain_g, (mode, ours_g, plain_g)
    deferred = _grads(
        model, lambda: (sp.logprobs(model, GROUPS, max_tokens=12, defer=True).logprobs.double() * W).sum().backward()
    )
    assert _err(deferred, want) <= 2 * plain_g


def test_control_without_the_autocast_the_model_is_refused_falsely(prepared, monkeypatch):
    """What the call did before: the head check ran the prepared (autocast) forward against a float32 head."""
    import contextlib

    from sharedprefix import api

    _, model = prepared
    monkeypatch.setattr(api, "in_forward_autocast", lambda m: contextlib.nullcontext())
    with pytest.raises(ValueError, match="turns hidden states into logits in a way sharedprefix does not reproduce"):
        with torch.no_grad():
            sp.logprobs(model, GROUPS)


def test_no_autocast_is_found_where_none_was_put():
    from accelerate.state import AcceleratorState

    assert forward_mode.forward_autocast(tiny_model()) is None
    try:
        assert forward_mode.forward_autocast(accelerate.Accelerator(cpu=True).prepare(tiny_model())) is None
    finally:
        AcceleratorState._reset_state(True)
