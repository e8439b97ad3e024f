"""sp.plan_step: what a user may do to the model between a step's microbatches (``schedule.step_rules``). Each thing
is either exact against the plain per-microbatch accumulation doing the same (float64, 1e-9) or refused at the first
call it affects, naming it: hooks registered after the first call, requires_grad changed, .grad cleared, the
autocast changed, a parameter's data replaced (refused); microbatches out of order, checkpointing toggled, an
unrelated backward or no-grad log-probs between them (exact)."""

import contextlib

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, plain_logprobs, random_groups, tiny_model
from support.schedule import microbatch_weights, split_groups

MBS = split_groups()
WS = microbatch_weights(MBS)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain(model, between=lambda k: None, order=(0, 1, 2)):
    """The plain accumulation, ``between(k)`` before each microbatch k but the first; .grad cleared before, after."""
    model.zero_grad(set_to_none=True)
    for i, k in enumerate(order):
        if i:
            between(k)
        (plain_logprobs(model, MBS[k])[0] * WS[k]).sum().backward()
    out = _grads(model)
    model.zero_grad(set_to_none=True)
    return out


def _step(model, between=lambda k: None, order=(0, 1, 2), deferred=False, context=None, **settings):
    """The step's calls in ``order``, ``between(k)`` before each but the first, each under ``context(k)``; the
    gradients. A call that raises leaves the step open (a refusal does not count as run): it is released."""
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, MBS, **settings)
    try:
        for i, k in enumerate(order):
            if i:
                between(k)
            with context(k) if context else contextlib.nullcontext():
                if deferred:
                    out = sp.logprobs(model, step.microbatch(k))
                else:
                    sp.backward(model, step.microbatch(k), lambda b, W=WS[k]: (b.logprobs * W[b.index] * b.mask).sum())
            if deferred:
                (out.logprobs * WS[k]).sum().backward()
        assert step.state == "finished"
        return _grads(model)
    finally:
        if step.state == "open":
            step.release()
        model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _at(k, fn):
    return lambda j: fn() if j == k else None


@pytest.mark.parametrize("kind", ["post_accumulate_grad", "tensor"])
def test_a_parameter_hook_registered_after_the_first_call_refused(model, kind):
    """Before: checked at the first call only, a hook registered after it ran on the step's per-call gradients (a
    reading hook saw microbatch 1's own share without its prompt's: 0.39 off the plain value), silently."""
    p = model.model.layers[0].self_attn.q_proj.weight
    handles = []

    def register():
        if kind == "tensor":
            handles.append(p.register_hook(lambda g: g))
        else:
            handles.append(p.register_post_accumulate_grad_hook(lambda t: None))

    words = "tensor hooks" if kind == "tensor" else "post-accumulate-grad hooks"
    try:
        with pytest.raises(ValueError, match=f"'model.layers.0.self_attn.q_proj.weight' has {words}"):
            _step(model, _at(1, register))
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("freeze", [True, False])
def test_requires_grad_changed_inside_a_step_refused(model, freeze, deferred):
    """Before: the step delivered every microbatch's shared share to the parameters trainable at its last call
    (1.39 relative error freezing a layer after microbatch 0, 1.01 unfreezing it), silently."""
    layer = model.model.layers[1]
    layer.requires_grad_(not freeze)
    try:
        with pytest.raises(RuntimeError, match=r"other trainable parameters than its first call .*model.layers.1"):
            _step(model, _at(1, lambda: layer.requires_grad_(freeze)), deferred=deferred)
    finally:
        layer.requires_grad_(True)


def test_requires_grad_changed_after_plan_step_before_its_first_call_exact(model):
    layer = model.model.layers[0]
    step = sp.plan_step(model, MBS)
    layer.requires_grad_(False)
    try:
        want = _plain(model)
        for k in range(3):
            sp.backward(model, step.microbatch(k), lambda b, W=WS[k]: (b.logprobs * W[b.index] * b.mask).sum())
        assert_grads_close(_grads(model), want, 1e-9)
    finally:
        layer.requires_grad_(True)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "clear, words",
    [
        ("zero_grad", "the .grad of 'model.embed_tokens.weight' is None now"),
        ("zero_grad_in_place", "every .grad written since is all zero"),
        ("one_to_none", "the .grad of 'model.layers.0.mlp.up_proj.weight' is None now"),
    ],
)
@pytest.mark.parametrize("deferred", [False, True])
def test_grad_cleared_between_microbatches_refused(model, clear, words, deferred):
    """Before: the plain accumulation lost microbatch 0's gradient, the step still delivered its shared prompts'
    share at the end (0.73 relative error for zero_grad, 0.25 for one p.grad = None), silently."""

    def do():
        if clear == "one_to_none":
            model.model.layers[0].mlp.up_proj.weight.grad = None
        else:
            model.zero_grad(set_to_none=clear == "zero_grad")

    with pytest.raises(RuntimeError, match=f"after .grad was cleared since its previous microbatch \\({words}"):
        _step(model, _at(2, do), deferred=deferred)


def test_zero_grad_between_the_parts_of_a_split_step_exact(model):
    """Between two parts of a step bounded by max_cached_tokens, the first part has delivered everything: clearing
    .grad there drops what the plain accumulation drops."""
    want = _plain(model, _at(2, model.zero_grad))
    assert_grads_close(_step(model, _at(2, model.zero_grad), max_cached_tokens=20), want, 1e-9)


@pytest.mark.parametrize("first", [True, False])
def test_autocast_changed_between_microbatches_refused(first):
    """Before: torch raised 'expected scalar type BFloat16 but found Float' inside the attention kernel (the cached
    prompts in the first call's dtype)."""
    m32 = tiny_model("qwen3", dtype=torch.float32)
    ws = [w.float() for w in WS]
    step = sp.plan_step(m32, MBS)
    autocast = lambda k: torch.autocast("cpu", dtype=torch.bfloat16) if (k == 0) == first else contextlib.nullcontext()  # noqa: E731
    with autocast(0):
        sp.backward(m32, step.microbatch(0), lambda b: (b.logprobs * ws[0][b.index] * b.mask).sum())
    said = r"autocast\('cpu', dtype=torch.bfloat16\)" if first else "no autocast"
    with pytest.raises(RuntimeError, match=f"microbatch 1 of a step runs under .* first call ran under {said}"):
        with autocast(1):
            sp.logprobs(m32, step.microbatch(1))
    assert step.state == "open"  # refused before it ran: the user may run it as the first
    with autocast(0):
        for k in (1, 2):
            sp.backward(m32, step.microbatch(k), lambda b, W=ws[k]: (b.logprobs * W[b.index] * b.mask).sum())
    assert step.state == "finished"


def test_parameter_data_replaced_between_microbatches_refused(model):
    """Before: ``p.data = ...`` (which leaves the version counter) went unnoticed; the cached prompts were the old
    weights'."""
    w = model.model.norm.weight
    saved = w.data
    try:
        with pytest.raises(RuntimeError, match=r"'model.norm.weight': its data replaced"):
            _step(model, _at(1, lambda: setattr(w, "data", saved * 1.01)))
    finally:
        w.data = saved


@pytest.mark.parametrize("deferred", [False, True])
def test_what_a_plain_accumulation_allows_between_microbatches_exact(model, deferred):
    """Microbatches in another order than declared, checkpointing switched on and off between them, an unrelated
    backward of other rows (plain, and an sp.backward of its own) and no-grad log-probs (reference log-probs) of
    other rows between them: the plain accumulation doing the same, 1e-9."""
    other = random_groups(11, 1, [7], [[4, 3]])
    wo = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def plain_between(k):
        (plain_logprobs(model, other)[0] * wo).sum().backward()

    def between(k):
        if k == 0:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            sp.backward(model, other, lambda b: (b.logprobs * wo[b.index] * b.mask).sum())
        else:
            model.gradient_checkpointing_disable()
            plain_between(k)
        with torch.no_grad():
            sp.logprobs(model, other)
            sp.logprobs(model, MBS[k])

    model.train()  # (checkpointing runs in training mode; the tiny model has no dropout)
    try:
        want = _plain(model, plain_between, order=(2, 0, 1))
        assert_grads_close(_step(model, between, order=(2, 0, 1), deferred=deferred), want, 1e-9)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
