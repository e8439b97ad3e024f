"""sp.backward: the accumulated gradient equals the gradient of the loss over all completions at once."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model
from support.schedule import MODES, SPEC, plain_reference, run_backward, weighted_loss


def test_prompt_split_into_four_chunks_runs_reverse_backward():
    groups = random_groups(1, 3, *SPEC)
    p = sp.plan(groups, 7)
    chain = p.tree.prompt_chain[2]
    assert len(chain) == 4  # prompt of 28 tokens under a 7-token budget
    back = [
        i for i, s in enumerate(p.steps) if isinstance(s, sp.schedule.PrefixBackward) and set(s.segments) <= set(chain)
    ]
    # one backward per chunk, innermost first, each after every pass of its subtree
    assert [p.steps[i].segments[0] for i in back] == chain[::-1]
    last = max(
        i
        for i, s in enumerate(p.steps)
        if isinstance(s, sp.schedule.Pass) and any(p.tree.segments[x].group == 2 for x in s.segments)
    )
    assert back[0] > last and back == list(range(back[0], back[0] + 4))


def test_a_budget_of_one_completion_gives_one_pass_per_completion():
    groups = random_groups(1, 1, [9], [[4, 4, 4]])
    p = sp.plan(groups, 4)
    comp_passes = [s for s in p.passes if not s.record]
    assert [len(s.segments) for s in comp_passes] == [1, 1, 1]


def test_float32_schedule_within_twice_plain_error():
    m64 = tiny_model("qwen3", dtype=torch.float64)
    m32 = tiny_model("qwen3", dtype=torch.float32)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    groups = random_groups(4, 2, [30, 18], [[12, 3, 9, 9], [5, 5, 5, 1, 16]])
    W = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact, _ = plain_reference(m64, groups, W)
    plain32 = grads_of(m32, lambda: (plain_logprobs(m32, groups)[0] * W.float()).sum())
    _, ours = run_backward(m32, groups, weighted_loss(W), max_tokens=20, prefix_activations="offload")
    for name in exact:
        plain_err = (plain32[name].double() - exact[name]).abs().max()
        our_err = (ours[name].double() - exact[name]).abs().max()
        assert our_err <= 2 * plain_err + 1e-6 * exact[name].abs().max(), name


@pytest.mark.parametrize("budget", [None, 20, 7])
def test_forward_only_logprobs_with_budget(budget):
    model = tiny_model("qwen3")
    groups = random_groups(1, 3, *SPEC)
    ref, _ = plain_logprobs(model, groups)
    with torch.no_grad():
        out = sp.logprobs(model, groups, max_tokens=budget)
    assert not out.logprobs.requires_grad
    assert (out.logprobs - ref).abs().max() <= 1e-9
    # with grad enabled and a budget, the graph stays connected through the cached prompt K/V
    W = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())
    got = grads_of(model, lambda: (sp.logprobs(model, groups, max_tokens=budget).logprobs * W).sum())
    assert_grads_close(got, want, 1e-9)


def test_logprobs_no_grad_keeps_no_graph_in_cache(monkeypatch):
    from sharedprefix.schedule import cache as cache_mod

    sealed = []
    orig = cache_mod.PrefixCache.seal

    def spy(self, seg, keep_graph):
        orig(self, seg, keep_graph)
        sealed.extend(t for kv in self.read_kv_[seg].values() for t in kv)

    monkeypatch.setattr(cache_mod.PrefixCache, "seal", spy)
    model = tiny_model("qwen3")
    with torch.no_grad():
        sp.logprobs(model, random_groups(1, 3, *SPEC), max_tokens=7)
    assert sealed and all(t.grad_fn is None and not t.requires_grad for t in sealed)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_model_is_exact(reentrant):
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    assert model.model.gradient_checkpointing
    groups = random_groups(1, 3, *SPEC)
    W = torch.randn(10, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, _ = plain_reference(model, groups, W)
    _, got = run_backward(model, groups, weighted_loss(W), max_tokens=None)  # whole groups: any checkpointing is exact
    assert_grads_close(got, want, 1e-9)
    if reentrant:
        with pytest.raises(ValueError, match="use_reentrant=True is on, and this plan splits a group"):
            run_backward(model, groups, weighted_loss(W), max_tokens=7)
        return
    for mode in MODES:
        _, got = run_backward(model, groups, weighted_loss(W), max_tokens=7, prefix_activations=mode)
        assert_grads_close(got, want, 1e-9)


# ---- errors -------------------------------------------------------------------------------------------------


def test_bad_loss_fn_results_are_refused_naming_the_call():
    model = tiny_model("llama")
    groups = random_groups(0, 1, [5], [[2, 3]])
    with pytest.raises(ValueError, match=r"shape \(3,\) on call 0; expected a scalar"):
        sp.backward(model, groups, lambda b: b.logprobs.sum(0))
    with pytest.raises(ValueError, match="without grad on call 0"):
        sp.backward(model, groups, lambda b: b.logprobs.detach().sum())
    with pytest.raises(ValueError, match="returned nan on call 0; expected a finite value"):
        sp.backward(model, groups, lambda b: b.logprobs.sum() * float("nan"))
    with pytest.raises(TypeError, match="returned a float"):
        sp.backward(model, groups, lambda b: 1.0)
    with pytest.raises(TypeError, match="loss_fn is a int"):
        sp.backward(model, groups, 3)


def test_a_model_with_nothing_to_train_is_refused_before_any_pass():
    model = tiny_model("llama").requires_grad_(False)
    groups = random_groups(0, 1, [5], [[2, 3]])
    for budget in (None, 6):  # whole, and a split whose cached prompt is a leaf with grad
        with pytest.raises(ValueError, match=r"none of whose \d+ parameters requires grad.*requires_grad_\(True\)"):
            sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=budget)
    model.model.norm.weight.requires_grad_(True)  # one trainable parameter is enough
    sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=6)
    assert model.model.norm.weight.grad is not None


def test_bad_budgets_and_modes_are_refused_with_the_fix():
    model = tiny_model("llama")
    groups = random_groups(0, 1, [5], [[2, 3, 9]])
    with pytest.raises(ValueError, match=r"completions\[2\] has 9 tokens but max_tokens=4.*Set max_tokens >= 9"):
        sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens=0; expected a positive"):
        sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=0)
    with pytest.raises(TypeError, match="max_tokens=2.5"):
        sp.logprobs(model, groups, max_tokens=2.5)
    with pytest.raises(
        ValueError, match=r"prefix_activations='swap'; expected one of \('keep', 'offload', 'recompute'\)"
    ):
        sp.backward(model, groups, lambda b: b.logprobs.sum(), prefix_activations="swap")
    with torch.no_grad(), pytest.raises(RuntimeError, match="under torch.no_grad"):
        sp.backward(model, groups, lambda b: b.logprobs.sum())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_wrappers_are_checkpointing(reentrant):
    """torch's ``apply_activation_checkpointing`` (accelerate's FSDP ``activation_checkpointing``, torchtitan) wraps
    layers in ``CheckpointWrapper``s, which recompute them in the backward: unseen, grad-enabled log-probs ran
    without deferring (non-reentrant: torch's CheckpointError; reentrant: gradients 1.2 away, silently) and a
    reentrant split ran (0.98 away)."""
    import functools

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    model = tiny_model("llama")
    impl = cw.CheckpointImpl.REENTRANT if reentrant else cw.CheckpointImpl.NO_REENTRANT
    layer = type(model.model.layers[0])
    wrap = functools.partial(cw.checkpoint_wrapper, checkpoint_impl=impl)
    cw.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer))
    assert isinstance(model.model.layers[0], cw.CheckpointWrapper)
    groups = random_groups(1, 3, *SPEC)
    W = torch.randn(10, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, _ = plain_reference(model, groups, W)
    _, got = run_backward(model, groups, weighted_loss(W), max_tokens=None)
    assert_grads_close(got, want, 1e-9)
    got = grads_of(model, lambda: (sp.logprobs(model, groups).logprobs * W).sum())  # it defers
    assert_grads_close(got, want, 1e-9)
    if reentrant:
        with pytest.raises(
            ValueError, match="use_reentrant=True is on, .* checkpoint_impl=CheckpointImpl.NO_REENTRANT"
        ):
            run_backward(model, groups, weighted_loss(W), max_tokens=7)
        return
    for mode in MODES:
        _, got = run_backward(model, groups, weighted_loss(W), max_tokens=7, prefix_activations=mode)
        assert_grads_close(got, want, 1e-9)
    got = grads_of(model, lambda: (sp.logprobs(model, groups, max_tokens=7).logprobs * W).sum())
    assert_grads_close(got, want, 1e-9)


def test_checkpointing_without_use_reentrant_counts_as_reentrant():
    """torch's checkpoint defaults to use_reentrant=True when the keyword is absent; that must be refused too."""
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": True})
    model.train()
    groups = random_groups(1, 3, *SPEC)
    with pytest.raises(ValueError, match="use_reentrant=True is on"):
        sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=7)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_logprobs_defer_false_refused_under_checkpointing():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with pytest.raises(ValueError, match="defer=False with grad enabled is not possible with gradient checkpointing"):
        sp.logprobs(model, random_groups(1, 1, [5], [[2, 3]]), defer=False)


def _nan_on(call_to_fail):
    calls = []

    def loss(b):
        calls.append(1)
        value = (b.logprobs * b.mask).sum()
        return value * float("nan") if len(calls) == call_to_fail else value

    return loss


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_failed_call_leaves_grad_as_it_found_it(mode):
    model = tiny_model("qwen3")
    groups = random_groups(1, 3, *SPEC)
    assert len(sp.plan(groups, 8).passes) > 3
    # no gradient before: none after a NaN on the third pass
    with pytest.raises(ValueError, match="expected a finite value"):
        sp.backward(model, groups, _nan_on(3), max_tokens=8, prefix_activations=mode)
    assert all(p.grad is None for p in model.parameters())
    # gradients from an earlier call: exactly those after the failed call
    sp.backward(model, groups[:1], lambda b: b.logprobs.sum())
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(ValueError, match="expected a finite value"):
        sp.backward(model, groups, _nan_on(2), max_tokens=8, prefix_activations=mode)
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    # and a successful call still accumulates onto them
    sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=8, prefix_activations=mode)
    assert any(not torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if n in before)


def test_failed_deferred_logprobs_backward_leaves_no_partial_gradient():
    model = tiny_model("qwen3")
    groups = random_groups(1, 3, *SPEC)
    out = sp.logprobs(model, groups, max_tokens=8, defer=True)
    w = torch.ones_like(out.logprobs)
    w[-1, 0] = float("nan")  # the last group's completions run in the last passes: earlier passes already ran
    with pytest.raises(ValueError, match="expected a finite value"):
        (out.logprobs * w).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_deferred_logprobs_refuse_a_backward_after_the_parameters_changed():
    """Plain autograd raises when a saved weight was modified in place before the backward; a deferred call, whose
    backward recomputes the forward, would silently give the gradient at the new parameters instead. (The cache path
    of hybrids: tests/model/test_hybrid.py.)"""
    model = tiny_model("qwen3")
    groups = random_groups(1, 3, *SPEC)
    out = sp.logprobs(model, groups, max_tokens=8, defer=True)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.5)  # an in-place update between the call and its backward
    with pytest.raises(
        RuntimeError, match=r"after 1 of the model's parameters were modified in place .*'(lm_head|model.embed_tokens)"
    ):  # tied
        out.logprobs.sum().backward()
    assert all(p.grad is None for p in model.parameters())
    # computed again after the change, the log-probs backpropagate
    out = sp.logprobs(model, groups, max_tokens=8, defer=True)
    out.logprobs.sum().backward()
    assert model.get_output_embeddings().weight.grad is not None
