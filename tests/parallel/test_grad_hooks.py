"""Post-accumulate-grad hooks see what one plain backward gives them, however many backwards a call runs.

A plain step fires each parameter's ``register_post_accumulate_grad_hook`` hooks once, on the step's whole gradient.
The hooks here are the kinds users meet: an in-place transform of ``.grad`` (transformers' tensor-parallel all-reduce
of a replicated parameter is one: an in-place sum over ranks, here a doubling on one process), an optimizer stepped
inside the backward (transformers' layer-wise optimizers), and a counter. Each is checked under budgets that split
groups (several backwards per call), in every prefix mode, with gradients already present, and with a control run
that fires the hooks per backward, which must differ.
"""

import contextlib

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, refused_on_second_call, tiny_model
from sharedprefix.parallel import grad_hooks

GROUPS = random_groups(11, 2, [30, 5], [[6, 6, 6], [2, 3]])
BUDGET = 16  # splits the first group: its prompt is cached, its completions and its deferred backward come later
W = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def loss_fn(b):
    return (b.logprobs * W[b.index, : b.logprobs.shape[1]]).sum()


def hooked(model, hook):
    """``hook`` on every per-head norm weight (Qwen3's q_norm / k_norm: what transformers' TP hooks)."""
    params = [p for n, p in model.named_parameters() if "_norm." in n and "layernorm" not in n]
    assert params
    return [p.register_post_accumulate_grad_hook(hook) for p in params]


def doubled(p):
    p.grad.mul_(2.0)  # in place on the accumulated gradient, as an all-reduce over two equal ranks would


def plain_grads(model):
    return grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * W).sum())


def sp_grads(model, mode):
    return grads_of(
        model, lambda: sp.backward(model, GROUPS, loss_fn, max_tokens=BUDGET, prefix_activations=mode) and None
    )


@pytest.mark.parametrize("mode", ["keep", "recompute", "offload"])
def test_an_in_place_grad_hook_runs_once_per_call(mode):
    model = tiny_model("qwen3")
    hooked(model, doubled)
    assert any(isinstance(s, sp.schedule.PrefixBackward) for s in sp.plan(GROUPS, BUDGET).steps)
    assert_grads_close(sp_grads(model, mode), plain_grads(model), 1e-9)


def test_control_hooks_fired_per_backward_differ(monkeypatch):
    """The same call with the hooks left to fire at every backward (what happened before): the norm gradients differ,
    so the test above can fail."""
    model = tiny_model("qwen3")
    hooked(model, doubled)
    monkeypatch.setattr(
        grad_hooks.DeferredGradHooks, "during_backward", lambda self, last=False: contextlib.nullcontext()
    )
    got, want = sp_grads(model, "keep"), plain_grads(model)
    with pytest.raises(AssertionError, match="_norm.weight: relative error"):
        assert_grads_close(got, want, 1e-3)


def test_hooks_see_the_gradient_already_accumulated_once():
    """Gradients present before the call (an earlier micro-step): the hook runs once on earlier + this call's, as a
    second plain backward would, and every hook of the parameter keeps its handle."""
    model = tiny_model("qwen3")
    calls = []
    handles = hooked(model, doubled) + hooked(model, lambda p: calls.append(p))
    n_params = len(handles) // 2

    def twice(fn):
        model.zero_grad(set_to_none=True)
        fn()
        fn()
        out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    want = twice(lambda: (plain_logprobs(model, GROUPS)[0] * W).sum().backward())
    n_plain, calls[:] = len(calls), []
    got = twice(lambda: sp.backward(model, GROUPS, loss_fn, max_tokens=BUDGET))
    assert len(calls) == n_plain == 2 * n_params  # once per parameter and call, plain or ours
    assert_grads_close(got, want, 1e-9)
    for h in handles:  # the user's handles still remove their hooks
        h.remove()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_an_optimizer_stepped_in_the_backward_steps_once_on_the_whole_gradient():
    """Layer-wise optimizers (an SGD step in each parameter's hook, then zero_grad): the parameters after the call
    are the plain run's."""

    def with_optimizer_in_backward():
        model = tiny_model("qwen3")
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

        def step(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        return model

    plain, ours = with_optimizer_in_backward(), with_optimizer_in_backward()
    (plain_logprobs(plain, GROUPS)[0] * W).sum().backward()
    sp.backward(ours, GROUPS, loss_fn, max_tokens=BUDGET)
    before = dict(tiny_model("qwen3").named_parameters())
    for (n, p), q in zip(plain.named_parameters(), ours.parameters()):
        moved = (p - before[n]).detach().abs().max()
        assert moved > 0, n
        assert float((q - p).detach().abs().max() / moved) <= 1e-9, n
        assert q.grad is None and p.grad is None


def test_a_failing_call_fires_no_hook():
    model = tiny_model("qwen3")
    calls = []
    hooked(model, lambda p: calls.append(p))

    with pytest.raises(ValueError, match="second pass refused"):
        sp.backward(model, GROUPS, refused_on_second_call(loss_fn), max_tokens=BUDGET)
    assert calls == [] and all(p.grad is None for p in model.parameters())


def test_a_hook_registered_during_a_backward_is_refused():
    """A hook that appears in the middle of a backward (a recomputed forward registering it) already ran on one pass's
    share: refused with the fix, and the call leaves no gradient behind."""
    model = tiny_model("qwen3")
    norm = model.model.layers[0].self_attn.q_norm

    def register_late(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: norm.weight.register_post_accumulate_grad_hook(doubled) and None)

    model.model.layers[1].register_forward_hook(sp.allow_hook(register_late))
    with pytest.raises(RuntimeError, match="gained a gradient hook during a sharedprefix backward"):
        sp.backward(model, GROUPS, loss_fn, max_tokens=BUDGET)
    assert all(p.grad is None for p in model.parameters())
