"""sp.plan_step: one optimizer step's microbatches over one prefix cache, against the plain per-row run of each
microbatch summed (float64), for groups and trees, every prefix mode and budget, sp.backward and deferred
sp.logprobs; and the step's rules (microbatches run twice or never, hooks, failures)."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model
from support.schedule import MODES, microbatch_weights, split_groups
from support.trees import plain_rows
from support.vl import mrope_model, plain_mrope, vl_microbatches


def _plain(model, mbs, Ws):
    """The plain accumulation: each microbatch's rows through the model's own forward, summed."""

    def loss():
        total = 0
        for mb, W in zip(mbs, Ws):
            lp = _plain_rows(model, mb)
            total = total + (lp * W).sum()
        return total

    return grads_of(model, loss)


def _plain_rows(model, mb):
    if isinstance(mb, sp.Tree):
        return plain_tree_logprobs(model, mb)
    return plain_logprobs(model, mb)[0]


def plain_tree_logprobs(model, tree):
    """(N, L) log p(row[t] | row[:t]) where trained, by the model's own forward of each row."""
    return plain_rows(model, [r.tolist() for r in tree.rows], [t.tolist() for t in tree.trained])


def _loss(W):
    return lambda b: (b.logprobs * W[b.index] * b.mask).sum()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [None, 12, 6])
def test_groups_split_over_microbatches_exact(model, mode, budget):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs, Ws)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode)
    if budget is None:  # the two shared prompts: recorded by one pass, backpropagated by one round
        assert [p.record for p in step.splan.record] == [step.splan.shared]
        assert [b.segments for b in step.splan.backward] == [step.splan.shared]
    tokens = 0
    for k, W in enumerate(Ws):
        tokens += sp.backward(model, step.microbatch(k), _loss(W)).tokens_computed
    assert_grads_close(_grads(model), want, 1e-9)
    # each prompt once for the step (recompute runs the shared prompts' forward again at the end)
    prompts, completions = 20 + 9, 21 + 10
    assert tokens == prompts + completions + (prompts if mode == "recompute" else 0)
    assert step.state == "finished" and len(step.cache.segments()) == 0
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_deferred_logprobs_of_a_step_exact(model, mode):
    """TRL's way: grad-enabled log-probs per microbatch, the caller's backward, the prompts' backward at the last."""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs, Ws)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=12, prefix_activations=mode)
    for k, W in enumerate(Ws):
        out = sp.logprobs(model, step.microbatch(k), entropy=True)
        ref = plain_logprobs(model, mbs[k])[0]
        assert out.logprobs.shape == ref.shape
        assert (out.logprobs.detach() - ref).abs().max() <= 1e-9
        assert step.state == "open"
        (out.logprobs * W).sum().backward()
    assert step.state == "finished"
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_deferred_logprobs_of_a_step_backward_with_inputs_exact(model, mode):
    """``loss.backward(inputs=...)`` on a step's deferred log-probs: the named parameters get the plain
    accumulation's gradient (the shared prompts' share included), every other one none, as in the plain run."""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    chosen = [p for n, p in model.named_parameters() if "layers.1." in n or "embed" in n]
    model.zero_grad(set_to_none=True)
    for mb, W in zip(mbs, Ws):
        (_plain_rows(model, mb) * W).sum().backward(inputs=chosen)
    want = _grads(model)
    assert len(want) == len(chosen)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, prefix_activations=mode)
    for k, W in enumerate(Ws):
        (sp.logprobs(model, step.microbatch(k)).logprobs * W).sum().backward(inputs=chosen)
    assert step.state == "finished"
    got = _grads(model)
    assert got.keys() == want.keys()
    assert_grads_close(got, want, 1e-9)
    model.zero_grad(set_to_none=True)


def _trees():
    """Rows with a shared system prefix and shared turns across microbatches, a row repeated in two microbatches
    (its every segment shared: reported from cached values only) and a row that is a prefix of another's."""
    gen = torch.Generator().manual_seed(7)
    sys_p = torch.randint(0, 100, (10,), generator=gen)
    turn = torch.randint(0, 100, (6,), generator=gen)
    tails = [torch.randint(0, 100, (n,), generator=gen) for n in (4, 3, 5, 2)]
    a = torch.cat([sys_p, turn, tails[0]])
    b = torch.cat([sys_p, turn, tails[1]])
    c = torch.cat([sys_p, tails[2]])
    d = torch.cat([sys_p, turn])  # a prefix of a and b
    e = torch.cat([sys_p, tails[3]])
    mask = lambda r, k: [t >= k for t in range(len(r))]  # noqa: E731
    mb0 = sp.Tree.from_rows([a, c], [mask(a, 10), mask(c, 10)])
    mb1 = sp.Tree.from_rows([a.clone()], [mask(a, 10)])  # a again: every value cached, no token to compute
    mb2 = sp.Tree.from_rows([d, b, e], [mask(d, 1), mask(b, 12), mask(e, 1)])
    return [mb0, mb1, mb2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [None, 9])
def test_trees_with_repeated_and_prefix_rows_exact(model, mode, budget):
    mbs = _trees()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs, Ws)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode)
    assert any(s.segments == () for s in step.splan.microbatches[1])  # row a of microbatch 1: values only
    for k, W in enumerate(Ws):
        with torch.no_grad():
            ref = plain_tree_logprobs(model, mbs[k])
        out = sp.logprobs(model, step.microbatch(k))
        assert (out.logprobs.detach() - ref).abs().max() <= 1e-9
        (out.logprobs * W).sum().backward()
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


def test_one_microbatch_is_a_budget_split_call(model):
    """A step of one microbatch plans exactly the passes of a call (one schedule)."""
    groups = random_groups(1, 3, [12, 3, 28], [[3, 4, 1, 5], [2], [6, 6, 2, 1, 7]])
    for budget in (None, 20, 7):
        step = sp.plan_step(model, [groups], max_tokens=budget)
        assert step.splan.shared == ()
        assert list(step.splan.microbatches[0]) == sp.plan(groups, budget).steps


def test_microbatch_run_twice_refused(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    step = sp.plan_step(model, mbs)
    sp.backward(model, step.microbatch(0), _loss(Ws[0]))
    with pytest.raises(RuntimeError, match="microbatch 0 of this step already ran"):
        sp.backward(model, step.microbatch(0), _loss(Ws[0]))
    for k in (1, 2):
        sp.backward(model, step.microbatch(k), _loss(Ws[k]))
    with pytest.raises(RuntimeError, match="run after its step finished"):
        sp.backward(model, step.microbatch(1), _loss(Ws[1]))
    model.zero_grad(set_to_none=True)


def test_call_settings_of_a_microbatch(model):
    """A microbatch's call may set what each call sets (temperature, entropies: the shared prompts' cache is the
    same), exact against the plain rows at that temperature; a setting of the step's plan (the budget, the backend)
    with another value is refused naming the step and sp.plan_step, and the refused call does not count as run."""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)

    def plain():
        return sum((plain_logprobs(model, mb, temperature=0.7)[0] * W).sum() for mb, W in zip(mbs, Ws))

    want = grads_of(model, plain)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs)
    with pytest.raises(ValueError, match=r"max_tokens=8 disagrees with the step's max_tokens=None.*sp.plan_step"):
        sp.backward(model, step.microbatch(0), _loss(Ws[0]), max_tokens=8, temperature=0.7)
    for k, W in enumerate(Ws):
        sp.backward(model, step.microbatch(k), _loss(W), temperature=0.7, entropy=k == 1)
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


def test_unfinished_step_named_by_the_next_step_and_call(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    step = sp.plan_step(model, mbs)
    sp.backward(model, step.microbatch(0), _loss(Ws[0]))
    with pytest.raises(RuntimeError, match=r"microbatch\(es\) \[1, 2\] of 3 never ran"):
        sp.plan_step(model, mbs)
    # a call outside the step is fine while the parameters are unchanged (a metric, a reference pass) ...
    with torch.no_grad():
        sp.logprobs(model, mbs[0])
        # ... but not once an optimizer step ran without the missing microbatches
        next(model.parameters()).add_(0.0)
    with pytest.raises(RuntimeError, match="never ran their backward"):
        sp.logprobs(model, mbs[0])
    with pytest.raises(RuntimeError, match="parameters changed in place"):
        sp.backward(model, step.microbatch(1), _loss(Ws[1]))
    step.release()
    assert step.state == "released" and not step.cache.segments()
    sp.plan_step(model, mbs)  # the model is free again
    model.zero_grad(set_to_none=True)


def test_finish_delivers_the_share_of_the_microbatches_that_ran(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs[:2], Ws[:2])
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs)
    for k in (0, 1):
        sp.backward(model, step.microbatch(k), _loss(Ws[k]))
    partial = _grads(model)
    with pytest.raises(AssertionError):  # control: without finish, the prompts' share is missing
        assert_grads_close(partial, want, 1e-9)
    step.finish(model)
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_failure_leaves_the_plain_accumulation_of_what_ran(model, mode):
    """A microbatch whose loss raises: .grad is the plain accumulation of the microbatches before it, the cache is
    released, and the step is closed."""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs[:1], Ws[:1])
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=6, prefix_activations=mode)
    sp.backward(model, step.microbatch(0), _loss(Ws[0]))
    calls = []

    def failing(b):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("second pass refused")
        return _loss(Ws[2])(b)

    with pytest.raises(ValueError, match="second pass refused"):  # microbatch 2 (of several passes), not the last
        sp.backward(model, step.microbatch(2), failing)
    assert len(calls) == 2 and step.state == "failed" and not step.cache.segments()
    assert_grads_close(_grads(model), want, 1e-9)
    with pytest.raises(RuntimeError, match="run after its step failed"):
        sp.backward(model, step.microbatch(1), _loss(Ws[1]))
    model.zero_grad(set_to_none=True)


def test_failure_in_the_last_microbatch_keeps_the_earlier_share(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs[:2], Ws[:2])
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=6)
    for k in (0, 1):
        sp.backward(model, step.microbatch(k), _loss(Ws[k]))

    def failing(b):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        sp.backward(model, step.microbatch(2), failing)
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


def test_a_failed_delivery_after_a_failure_keeps_the_callers_error(model, monkeypatch):
    """Where delivering the completed microbatches' shared share after a failed call raises too, the call's own error
    is raised (the user's, naming their problem), with a note that .grad lacks that share; the step is closed. (Before:
    the delivery's error replaced the user's.)"""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    step = sp.plan_step(model, mbs)
    sp.backward(model, step.microbatch(0), _loss(Ws[0]))

    def broken(self, model):
        raise RuntimeError("delivery broke")

    def failing(b):
        raise ValueError("the user's loss refused")

    monkeypatch.setattr(sp.Step, "_deliver_partial", broken)
    with pytest.raises(ValueError, match="the user's loss refused") as info:
        sp.backward(model, step.microbatch(1), failing)
    notes = getattr(info.value, "__notes__", [])
    assert any(".grad lacks the completed microbatches' shared share" in n and "delivery broke" in n for n in notes)
    assert step.state == "failed" and not step.cache.segments()
    model.zero_grad(set_to_none=True)


def test_parameter_hooks_refused_at_the_first_call(model):
    p = next(model.parameters())
    handle = p.register_hook(lambda g: g)
    try:
        step = sp.plan_step(model, split_groups())
        with pytest.raises(ValueError, match="tensor hooks .* once per microbatch"):
            sp.backward(model, step.microbatch(0), _loss(microbatch_weights(split_groups())[0]))
        assert step.state == "planned"
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)


def test_microbatch_of_another_model_or_step_refused(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    other = tiny_model("qwen3", seed=1)
    step = sp.plan_step(model, mbs)
    with pytest.raises(ValueError, match="planned for another model"):
        sp.backward(other, step.microbatch(0), _loss(Ws[0]))
    step2 = sp.plan_step(model, mbs)
    sp.backward(model, step2.microbatch(0), _loss(Ws[0]))
    with pytest.raises(RuntimeError, match="belongs to a step other than the one under way"):
        sp.backward(model, step.microbatch(1), _loss(Ws[1]))
    step2.release()
    with pytest.raises(ValueError, match="expected an int in"):
        step.microbatch(3)
    model.zero_grad(set_to_none=True)


def test_bad_microbatches_refused(model):
    g = random_groups(1, 1, [5], [[2, 3]])
    with pytest.raises(TypeError, match="mixes sp.Tree"):
        sp.plan_step(model, [g, sp.Tree.from_rows([[1, 2, 3]])])
    with pytest.raises(TypeError, match="expected a non-empty list"):
        sp.plan_step(model, g[0])
    with pytest.raises(ValueError, match="microbatch 1 of the step: groups is empty"):  # which one, named
        sp.plan_step(model, [g, [], g])
    with pytest.raises(TypeError, match="microbatch 2 of the step: groups is a single Group"):
        sp.plan_step(model, [g, g, g[0]])


def test_float32_step_within_twice_plain_error():
    m64 = tiny_model("qwen3", dtype=torch.float64)
    m32 = tiny_model("qwen3", dtype=torch.float32)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    exact = _plain(m64, mbs, Ws)
    plain32 = grads_of(m32, lambda: sum((plain_logprobs(m32, mb)[0] * W.float()).sum() for mb, W in zip(mbs, Ws)))
    step = sp.plan_step(m32, mbs, max_tokens=12, prefix_activations="offload")
    for k, W in enumerate(Ws):
        sp.backward(m32, step.microbatch(k), _loss(W.float()))
    ours = _grads(m32)
    for name in exact:
        plain_err = (plain32[name].double() - exact[name]).abs().max()
        our_err = (ours[name].double() - exact[name]).abs().max()
        assert our_err <= 2 * plain_err + 1e-6 * exact[name].abs().max(), name


def test_max_cached_tokens_splits_the_step_into_parts(model):
    """A bound on what the step caches: parts of consecutive microbatches, each within it, still exact."""
    mbs = split_groups()  # shared: group 0's prompt (20 tokens) and group 1's (9)
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs, Ws)
    assert sp.plan_step(model, mbs, max_cached_tokens=29).splan.shared_tokens == 29  # within: one step
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_cached_tokens=20)
    assert isinstance(step, sp.SplitStep) and len(step) == 3
    assert [p.offset for p in step.parts] == [0, 2] and step.tokens_cached <= 20
    tokens = sum(sp.backward(model, step.microbatch(k), _loss(W)).tokens_computed for k, W in enumerate(Ws))
    assert step.state == "finished" and step.missing == []
    assert tokens > 20 + 9 + 31  # a prompt computed in two parts: the bound trades memory for recomputation
    assert_grads_close(_grads(model), want, 1e-9)
    with pytest.raises(ValueError, match="max_cached_tokens=-1"):
        sp.plan_step(model, mbs, max_cached_tokens=-1)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", MODES)
def test_graph_kept_logprobs_of_a_step_exact(model, mode):
    """defer=False (one process): each microbatch's graph kept, the shared prompts' backward at the end of the
    caller's backward through the last microbatch; no second forward of the completions."""
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    want = _plain(model, mbs, Ws)
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs, max_tokens=12, prefix_activations=mode)
    for k, W in enumerate(Ws):
        out = sp.logprobs(model, step.microbatch(k), defer=False, entropy=True)
        assert out.logprobs.grad_fn is not None
        assert (out.logprobs.detach() - plain_logprobs(model, mbs[k])[0]).abs().max() <= 1e-9
        ((out.logprobs * W).sum() + 0.0 * out.entropy.sum()).backward()
        assert step.state == ("finished" if k == 2 else "open")
    assert_grads_close(_grads(model), want, 1e-9)
    model.zero_grad(set_to_none=True)


def test_graph_kept_logprobs_refuse_autograd_grad_and_a_second_backward(model):
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    step = sp.plan_step(model, mbs)
    out = sp.logprobs(model, step.microbatch(0), defer=False)
    loss = (out.logprobs * Ws[0]).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="did not reach the step's cached prompts"):
        torch.autograd.grad(loss, params, retain_graph=True)
    assert step.state == "failed"
    # backward(inputs=...) names the leaves it accumulates into: the cached prompts are not among them
    step = sp.plan_step(model, mbs)
    out = sp.logprobs(model, step.microbatch(0), defer=False)
    with pytest.raises(RuntimeError, match=r"loss.backward\(inputs=...\)"):
        (out.logprobs * Ws[0]).sum().backward(inputs=params[:3])
    assert step.state == "failed"
    model.zero_grad(set_to_none=True)
    step = sp.plan_step(model, mbs)
    out = sp.logprobs(model, step.microbatch(0), defer=False)
    loss = (out.logprobs * Ws[0]).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated again"):
        loss.backward()
    step.release()
    # a group of microbatch 0 alone, larger than the budget: its prompt is cached inside the microbatch's own call
    alone = random_groups(5, 1, [10], [[5, 5]])
    big = sp.plan_step(model, [alone + mbs[0], mbs[1]], max_tokens=8)
    assert any(st.record for st in big.splan.microbatches[0] if isinstance(st, sp.schedule.Pass))
    with pytest.raises(ValueError, match="defer=False on microbatch 0 of a step whose own rows are larger"):
        sp.logprobs(model, big.microbatch(0), defer=False)
    assert big.state == "planned"  # refused before the step began
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode, budget", [("keep", None), ("recompute", None), ("recompute", 16), ("offload", 16)])
def test_vision_language_groups_split_over_microbatches_exact(mode, budget):
    """Groups with prompt_inputs (images, M-RoPE positions) in a step: each image prompt and its vision tower once
    for the step, the gradients (vision tower included) those of the plain rows of each microbatch, summed."""
    model = mrope_model("qwen2_vl")
    mbs = vl_microbatches()
    Ws = microbatch_weights(mbs)
    want = grads_of(model, lambda: sum((plain_mrope(model, mb) * W).sum() for mb, W in zip(mbs, Ws)))
    patches: list[int] = []
    model.model.visual.register_forward_hook(sp.allow_hook(lambda m, i, o: patches.append(i[0].shape[0])))
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode)
    assert len(step.splan.shared) == 2  # group 0's and group 1's prompts (11 and 5 tokens); not the twin's
    tokens = sum(sp.backward(model, step.microbatch(k), _loss(W)).tokens_computed for k, W in enumerate(Ws))
    got = _grads(model)
    assert_grads_close(got, want, 1e-9)
    assert any("visual" in n for n in got)
    prompts, completions = 11 + 5 + 11 + 3 + 6, 8 + 7 + 2 + 2 + 1
    assert tokens == prompts + completions + (11 + 5 if mode == "recompute" else 0)
    # each image through the tower once (the shared ones again with grad under recompute): 16, 8, 16, 8 patches
    assert sum(patches) == 16 + 8 + 16 + 8 + (16 + 8 if mode == "recompute" else 0)
