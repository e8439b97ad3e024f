"""Every kind of hook sees what one plain backward shows it, or the call is refused; ``.grad`` is accumulated in place.

sharedprefix runs in several backwards (one per pass under a budget, a cached prompt's deferred backward) what a
plain step runs once. Here, in float64 against the plain per-row run with the same hook, under a budget of one
completion per pass (a group split over passes) and in every prefix mode: a tensor hook that is not linear (a clamp)
runs once, on the call's total; a deferred call whose caller's loss also reaches a parameter directly (an L2 penalty)
runs that parameter's hooks once, on the sum; module hooks are refused, naming the hook and the module, unless
declared token-wise; ``.grad`` tensors present before a call (views into one flat buffer) are the ``.grad`` after it.
Each mechanism has a control that must fail.
"""

import functools

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, plain_logprobs, random_groups, refused_on_second_call, tiny_model
from sharedprefix.parallel import grad_hooks

GROUPS = random_groups(11, 2, [30, 5], [[6, 6, 6], [2, 3]])
BUDGET = 8  # a chain of cached prompt segments (30 tokens), then each completion (6) in a pass of its own
W = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
MODES = ["keep", "offload", "recompute"]


def loss_fn(b):
    return (b.logprobs * W[b.index, : b.logprobs.shape[1]]).sum()


def plain_loss(model):
    return (plain_logprobs(model, GROUPS)[0] * W).sum()


def run_sp(model, mode="keep", budget=BUDGET):
    sp.backward(model, GROUPS, loss_fn, max_tokens=budget, prefix_activations=mode)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def clamped(model, bound):
    """A clamp of every parameter's incoming gradient to +-bound[0] (bound set later), counting the calls."""
    calls = []

    def clamp(g):
        calls.append(1)
        return g.clamp(-bound[0], bound[0])

    for p in model.parameters():
        p.register_hook(clamp)
    return calls


def test_the_budget_runs_one_completion_per_pass():
    plan = sp.plan(GROUPS, BUDGET)
    assert any(isinstance(s, sp.schedule.PrefixBackward) for s in plan.steps)
    first = [s for s in plan.passes if any(r < 3 for r in s.rows)]
    assert len(first) == 3 and all(len(s.rows) == 1 for s in first)


@pytest.mark.parametrize("mode", MODES)
def test_a_nonlinear_tensor_hook_runs_once_on_the_calls_gradient(mode):
    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    plain_loss(plain).backward()
    free = grads(plain)
    bound = [0.25 * max(float(g.abs().max()) for g in free.values())]  # clips the largest gradients
    plain.zero_grad(set_to_none=True)
    n_plain, n_ours = clamped(plain, bound), clamped(ours, bound)
    plain_loss(plain).backward()
    want = grads(plain)
    assert any(float((want[n] - free[n]).abs().max()) > 1e-3 for n in want)  # the clamp changed gradients
    run_sp(ours, mode)
    assert_grads_close(grads(ours), want, 1e-9)
    assert len(n_ours) == len(n_plain) == sum(1 for _ in plain.parameters())  # once per parameter


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_post_accumulate_hook_runs_once_on_the_calls_gradient(mode):
    """A post-accumulate hook doubling ``.grad`` in place (transformers' TP all-reduce over two equal ranks), with an
    earlier micro-step's gradient present: it runs once per parameter, on earlier + this call's, as in the plain
    run's second backward."""
    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    counts = {id(plain): [], id(ours): []}
    for m in (plain, ours):
        _flat_grads(m)
        c = counts[id(m)]
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p, c=c: c.append(p.grad.mul_(2.0)) and None)
    plain_loss(plain).backward()
    run_sp(ours, mode)
    assert len(counts[id(ours)]) == len(counts[id(plain)]) == sum(1 for _ in plain.parameters())
    assert_grads_close(grads(ours), grads(plain), 1e-9)


def test_control_tensor_hooks_left_in_each_backward_differ(monkeypatch):
    """The tensor hooks left in place during each backward (what happened before): each pass's share is clamped
    alone, and the gradients differ, so the test above can fail."""
    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    bound = [1e-3]
    clamped(plain, bound), clamped(ours, bound)
    plain_loss(plain).backward()
    init = grad_hooks._SetAside.__init__

    def keeping(self, attr, params, keep):
        init(self, attr, params, keep=keep or attr == "_backward_hooks")

    monkeypatch.setattr(grad_hooks._SetAside, "__init__", keeping)
    monkeypatch.setattr(grad_hooks, "run_tensor_hooks", lambda p, g: g)
    monkeypatch.setattr(sp.schedule.grads, "run_tensor_hooks", lambda p, g: g)
    run_sp(ours)
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close(grads(ours), grads(plain), 1e-3)


def _flat_grads(model):
    """Every parameter's ``.grad`` a view into one flat buffer holding 0.5 (an earlier micro-step's share, as DDP's
    bucket views and fused optimizers keep them). Returns the buffer."""
    params = list(model.parameters())
    flat = torch.full((sum(p.numel() for p in params),), 0.5, dtype=torch.float64)
    off = 0
    for p in params:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
    return flat


@pytest.mark.parametrize("mode", MODES)
def test_grad_is_accumulated_in_place_into_the_tensors_already_there(mode):
    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    _flat_grads(plain)
    plain_loss(plain).backward()
    flat = _flat_grads(ours)
    before = {n: p.grad for n, p in ours.named_parameters()}
    run_sp(ours, mode)
    assert all(p.grad is before[n] for n, p in ours.named_parameters())  # the same tensors
    assert_grads_close(grads(ours), grads(plain), 1e-9)
    assert_grads_close({"flat": flat}, {"flat": torch.cat([p.grad.flatten() for p in plain.parameters()])}, 1e-9)


def test_a_failing_call_leaves_the_flat_buffer_as_it_was():
    model = tiny_model("qwen3")
    flat = _flat_grads(model)
    before = {n: p.grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="second pass refused"):
        sp.backward(model, GROUPS, refused_on_second_call(loss_fn), max_tokens=BUDGET)
    assert all(p.grad is before[n] for n, p in model.named_parameters())
    assert bool((flat == 0.5).all())


def test_grad_is_created_only_where_there_was_none():
    model = tiny_model("qwen3")
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    kept = first.grad
    run_sp(model)
    assert first.grad is kept and all(p.grad is not None for p in model.parameters())


def _penalised(model, mode, defer):
    """An optimizer stepped in each parameter's post-accumulate hook; the policy's log-probs through sharedprefix
    (deferred, under the budget) or a plain forward, plus an L2 penalty on the head that reaches its weight
    directly; one backward. Returns the parameters after it and how often each hook ran."""
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    fired = []

    def step(p):
        fired.append(p)
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    if defer:
        lp = sp.logprobs(model, GROUPS, max_tokens=BUDGET, defer=True, prefix_activations=mode).logprobs
    else:
        lp = plain_logprobs(model, GROUPS)[0]
    loss = (lp * W).sum() + 0.5 * model.lm_head.weight.pow(2).sum()
    loss.backward()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, fired


@pytest.mark.parametrize("mode", MODES)
def test_a_deferred_call_and_a_direct_term_run_each_hook_once_on_their_sum(mode):
    init = {n: p.detach().clone() for n, p in tiny_model("qwen3").named_parameters()}
    want, n_plain = _penalised(tiny_model("qwen3"), mode, defer=False)
    got, n_ours = _penalised(tiny_model("qwen3"), mode, defer=True)
    assert len(n_ours) == len(n_plain) == len(init)
    for n in want:
        moved = float((want[n] - init[n]).abs().max())
        assert moved > 0, n
        assert float((got[n] - want[n]).abs().max()) <= 1e-9 * moved, n


def test_deferred_log_probs_give_their_gradient_to_autograd_grad():
    """``torch.autograd.grad`` through deferred log-probs returns the parameters' gradient (and writes no .grad)."""
    model = tiny_model("qwen3")
    params = list(model.parameters())
    want = torch.autograd.grad(plain_loss(model), params)
    lp = sp.logprobs(model, GROUPS, max_tokens=BUDGET, defer=True).logprobs
    got = torch.autograd.grad((lp * W).sum(), params)
    assert all(p.grad is None for p in params)
    assert_grads_close(dict(enumerate(got)), dict(enumerate(want)), 1e-9)


def test_control_a_committing_deferred_call_fires_the_head_hook_twice(monkeypatch):
    """The deferred call writing .grad itself inside the caller's backward (what happened before): the head's hook
    fires on the penalty's share and again on the call's, so the test above can fail."""
    real = sp.schedule.grads.synced

    def committing(*a, collect=False, **k):
        return real(*a, collect=False, **k), {}

    monkeypatch.setattr(sp.schedule.rounds, "synced", committing)
    _, fired = _penalised(tiny_model("qwen3"), "keep", defer=True)
    assert len(fired) > len(list(tiny_model("qwen3").parameters()))


# -- module hooks ----------------------------------------------------------------------------------------------------


def _register(model, kind, module, fn):
    m = {"layer": model.model.layers[0], "head": model.lm_head, "model": model, "norm": model.model.norm}[module]
    register = {
        "forward": m.register_forward_hook,
        "forward_pre": m.register_forward_pre_hook,
        "full_backward": m.register_full_backward_hook,
        "full_backward_pre": m.register_full_backward_pre_hook,
    }[kind]
    return register(fn)


def user_hook(*args):  # returns None: an observer, still refused (what it observes differs)
    return None


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward", "full_backward_pre"])
@pytest.mark.parametrize("module", ["layer", "head", "model", "norm"])
def test_module_hooks_are_refused_naming_the_hook_and_the_module(kind, module):
    model = tiny_model("qwen3")
    h = _register(model, kind, module, user_hook)
    name = {"layer": r"model\.layers\.0 \(Qwen3DecoderLayer\)", "head": r"lm_head \(Linear\)"}.get(module, "")
    for call in (
        lambda: sp.logprobs(model, GROUPS),
        lambda: run_sp(model),
        lambda: sp.logprobs(model, GROUPS, max_tokens=BUDGET, defer=True),
    ):
        with pytest.raises(ValueError, match=rf"test_hooks\.user_hook is registered on {name}.*allow_hook"):
            call()
    assert all(p.grad is None for p in model.parameters())
    h.remove()
    sp.logprobs(model, GROUPS)  # nothing left to refuse


def test_a_global_module_hook_is_refused():
    model = tiny_model("qwen3")
    h = torch.nn.modules.module.register_module_forward_hook(user_hook)
    try:
        with pytest.raises(ValueError, match="global forward hook .*user_hook is registered on every module"):
            sp.logprobs(model, GROUPS)
    finally:
        h.remove()


def test_a_declared_token_wise_hook_runs_and_is_exact():
    """An activation-steering vector added to every position of layer 0's output, declared with ``allow_hook``: the
    result is the plain run's with the same hook."""
    steer = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    @sp.allow_hook
    def steering(module, args, out):
        return (out[0] + steer,) + tuple(out[1:]) if isinstance(out, tuple) else out + steer

    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    for m in (plain, ours):
        m.model.layers[0].register_forward_hook(steering)
    plain_loss(plain).backward()
    run_sp(ours)
    want = grads(plain)
    assert_grads_close(grads(ours), want, 1e-9)
    free = tiny_model("qwen3")
    plain_loss(free).backward()
    assert float((grads(free)["model.norm.weight"] - want["model.norm.weight"]).abs().max()) > 1e-6  # it steers


class _Steering:
    def __init__(self, vector):
        self.vector = vector

    def hook(self, module, args, out):
        return _steer(module, args, out, self.vector)


def _steer(module, args, out, vector, scale=1.0):
    return (out[0] + scale * vector,) + tuple(out[1:]) if isinstance(out, tuple) else out + scale * vector


@pytest.mark.parametrize("kind", ["bound method", "partial"])
def test_a_declared_bound_method_or_partial_is_recognised_by_what_it_calls(kind):
    """``sp.allow_hook(obj.method)`` then ``register_forward_hook(obj.method)``: each read of ``obj.method`` is a new
    bound method, of the same function and instance, so it is allowed and the result is the plain run's with the
    hook; a ``functools.partial`` likewise, by its function, arguments and keywords (an equal float, another
    object). Control: the function bound to another instance, or a partial with another keyword, is refused."""
    steer = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    owner = _Steering(steer)
    if kind == "bound method":
        sp.allow_hook(owner.hook)
        make, other = (lambda: owner.hook), _Steering(steer).hook  # another instance
    else:
        sp.allow_hook(functools.partial(_steer, vector=steer, scale=float("2")))
        make = lambda: functools.partial(_steer, vector=steer, scale=float("2"))  # noqa: E731
        other = functools.partial(_steer, vector=steer, scale=3.0)
    plain, ours = tiny_model("qwen3"), tiny_model("qwen3")
    for m in (plain, ours):
        m.model.layers[0].register_forward_hook(make())
    plain_loss(plain).backward()
    run_sp(ours)
    want = grads(plain)
    assert_grads_close(grads(ours), want, 1e-9)
    free = tiny_model("qwen3")
    plain_loss(free).backward()
    assert float((grads(free)["model.norm.weight"] - want["model.norm.weight"]).abs().max()) > 1e-6  # it steers
    refused = tiny_model("qwen3")
    refused.model.layers[0].register_forward_hook(other)
    with pytest.raises(
        ValueError, match=r"forward hook \S*(_steer|_Steering\.hook) is registered on model\.layers\.0 .*allow_hook"
    ):
        sp.logprobs(refused, GROUPS)


def test_library_hooks_known_to_be_token_wise_run():
    """transformers' ``enable_input_require_grads`` (PEFT and TRL under gradient checkpointing) is allowed."""
    model = tiny_model("qwen3")
    model.enable_input_require_grads()
    assert model.get_input_embeddings()._forward_hooks
    with torch.no_grad():
        out = sp.logprobs(model, GROUPS)
    assert (out.logprobs - plain_logprobs(model, GROUPS)[0]).abs().max() <= 1e-9


def test_a_hook_registered_during_a_backward_is_refused():
    """A tensor hook that appears in the middle of a backward (a recomputed forward registering it) already ran on a
    pass's share: refused, and the call leaves no gradient behind."""
    model = tiny_model("qwen3")
    norm = model.model.layers[0].self_attn.q_norm

    @sp.allow_hook
    def register_late(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: norm.weight.register_hook(lambda x: x) and None)

    model.model.layers[1].register_forward_hook(register_late)
    with pytest.raises(RuntimeError, match="gained a gradient hook during a sharedprefix backward"):
        run_sp(model)
    assert all(p.grad is None for p in model.parameters())
