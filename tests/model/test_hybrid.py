"""Hybrid models on the cache-driven path (``schedule.cache_path``: Zaya, LFM3, MiniMax and others): each prompt once,
each completion from the prompt's final layer state, against the plain per-row forward in float64.

The gated delta-nets, short convolutions and Mamba2 mixers (LFM2, Qwen3-Next, Qwen3.5, OLMo-hybrid, Mamba2,
Nemotron-H, Falcon-H1, Zamba2, Bamba, Granite-4 hybrid) run on the packed path instead: tests/model/
test_hybrid_packed.py and test_hybrid_ssm.py; ``model_of`` and ``zoo_model`` (tests/support/hybrid.py) build the tiny
models of all three.
Zaya (the cache path's example here) computes parts in float32 even in a float64 model: the exactness test runs both
the plain forward and sharedprefix with those casts kept float64 (``Float64Inside``, the same code otherwise), and a
second test holds the model's own float32 layers to the flash-attention rule (at most twice the plain run's error).
"""

import copy

import pytest
import torch

import sharedprefix as sp
from sharedprefix.model import mixers
from sharedprefix.schedule.cache_path import run as cache_run
from sharedprefix.schedule.options import CallOptions
from sharedprefix.tools.reference import Float64Inside, plain_logprobs
from support.hybrid import groups_of, model_of, zoo_model


@pytest.fixture
def float64_inside():
    with Float64Inside():
        yield


_REF: dict = {}


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _grad_error(got, want):
    """Max over tensors of |got - want| / max|want| (a tensor whose gradient is zero: 1e-6 of the largest)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 1e-6 * max(float(w.abs().max()) for w in want.values())
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(floor)) for n in want)


def _mask(gs, width):
    lens = torch.tensor([c.numel() for g in gs for c in g.completions])
    return torch.arange(width)[None] < lens[:, None]


def _weights(shape):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def reference(key, model, gs, mode=None):
    """Plain per-row log-probs, entropies and the gradient of a random linear function of the log-probs (computed
    under ``mode()`` when given)."""
    import contextlib

    if key not in _REF:
        with mode() if mode else contextlib.nullcontext():
            lp, ent = plain_logprobs(model, gs, entropy=True)
            w = _weights(lp.shape)
            _REF[key] = lp.detach(), ent.detach(), _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    return _REF[key]


def _family(request, family):
    if family in FLOAT32_INSIDE:
        request.getfixturevalue("float64_inside")
    return model_of(family)


FAMILIES = ["zaya"]  # lfm2, qwen3_next, falcon_h1: the packed path (test_hybrid_packed.py, test_hybrid_ssm.py)
FLOAT32_INSIDE = {"zaya"}  # run under Float64Inside


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_and_gradients_match_the_plain_forward(request, family):
    """Float64 log-probs (and entropies) to 1e-9 in one pass and under a budget that chunks the 9-token prompt and
    splits its 4 completions; gradients of a linear function of the log-probs to a relative 1e-9 through
    ``logprobs``' graph and ``backward`` (in the three prefix modes, split and whole). Zaya runs float64
    throughout (``Float64Inside``)."""
    model = _family(request, family)
    gs = groups_of()
    lp_tol = grad_tol = 1e-9
    ref, ref_ent, want = reference(family + ("+float64" if family in FLOAT32_INSIDE else ""), model, gs)
    for max_tokens in (None, 6):
        with torch.no_grad():
            out = sp.logprobs(model, gs, entropy=True, max_tokens=max_tokens)
        assert out.logprobs.dtype == torch.float64 and out.logprobs.shape == ref.shape
        assert torch.equal(out.mask, _mask(gs, ref.shape[1]))
        assert float((out.logprobs - ref).abs().max()) <= lp_tol, (max_tokens, float((out.logprobs - ref).abs().max()))
        assert float((out.entropy - ref_ent).abs().max()) <= lp_tol
    w = _weights(ref.shape)
    got = _grads(model, lambda: (sp.logprobs(model, gs).logprobs * w).sum())  # one graph, grad enabled
    assert _grad_error(got, want) <= grad_tol
    runs = [("keep", 6), ("offload", None), ("recompute", 6)]
    for mode, max_tokens in runs:
        model.zero_grad(set_to_none=True)
        res = sp.backward(
            model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=max_tokens, prefix_activations=mode
        )
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert _grad_error(got, want) <= grad_tol, (mode, max_tokens, _grad_error(got, want))
        assert abs(res.loss - float((ref * w).sum())) <= 1e-9 * max(1.0, abs(res.loss))
        assert res.tokens_computed < res.tokens_plain and res.tokens_plain == sum(
            (g.prompt.numel() + c.numel()) for g in gs for c in g.completions
        )


@pytest.mark.parametrize("family", sorted(FLOAT32_INSIDE))
def test_own_float32_layers_within_twice_the_plain_error(family):
    """With the model's own float32 parts, a float64 Zaya is float32-accurate there:
    hold the hybrid path to the flash-attention rule against the float64 result (``Float64Inside``): at most twice
    the plain run's own error, for the log-probs and for the gradients (max relative error over tensors)."""
    model, gs = model_of(family), groups_of()
    truth, _, g_truth = reference(family + "+float64", model, gs, Float64Inside)
    w = _weights(truth.shape)
    plain = plain_logprobs(model, gs)[0].detach()
    with torch.no_grad():
        ours = sp.logprobs(model, gs, max_tokens=6).logprobs
    assert float((ours - truth).abs().max()) <= 2 * float((plain - truth).abs().max())
    g_plain = _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    g_ours = _grads(model, lambda: (sp.logprobs(model, gs).logprobs * w).sum())
    assert _grad_error(g_ours, g_truth) <= 2 * _grad_error(g_plain, g_truth)


@pytest.mark.parametrize("family, slot", [("zaya", "conv_states"), ("zaya", "keys"), ("zaya", "recurrent_states")])
def test_a_completion_that_does_not_start_from_the_prompts_state_is_caught(monkeypatch, family, slot):
    """The exactness test can fail: completions started from a zeroed conv state, zeroed prompt keys or a zeroed
    recurrent state give log-probs far (1000x) beyond the 1e-9 tolerance (random weights of std 0.02 make the
    differences small in absolute terms)."""
    model, gs = model_of(family), groups_of()
    ref = reference(family, model, gs)[0]
    read = cache_run.read_states  # (the model's own float32 layers: their rounding is far below what is asserted here)
    monkeypatch.setattr(
        cache_run,
        "read_states",
        lambda cache, slots: [
            torch.zeros_like(t) if name == slot else t for (_, name, _), t in zip(slots, read(cache, slots))
        ],
    )
    with torch.no_grad():
        out = sp.logprobs(model, gs)
    assert float((out.logprobs - ref).abs().max()) > 1e-6


def test_gradients_reach_the_prompt_through_its_state(monkeypatch):
    """Detaching the prompt's state (log-probs unchanged) loses the gradient the completions send into the prompt
    through its conv, recurrent and attention state: the comparison with the plain gradient catches it."""
    model, gs = model_of("zaya"), groups_of()
    ref, _, want = reference("zaya+float64", model, gs, Float64Inside)
    read = cache_run.read_states
    monkeypatch.setattr(cache_run, "read_states", lambda cache, slots: [t.detach() for t in read(cache, slots)])
    w = _weights(ref.shape)
    with Float64Inside():
        out = sp.logprobs(model, gs)
        assert float((out.logprobs.detach() - ref).abs().max()) <= 1e-9
        got = _grads(model, lambda: (sp.logprobs(model, gs).logprobs * w).sum())
    assert _grad_error(got, want) > 1e-6


@pytest.mark.parametrize("trained, mode", [("model.norm.", "keep"), ("q_proj", "recompute")])
def test_backward_with_frozen_layers_under_the_prompt_state(trained, mode):
    """Only some parameters trained (LoRA, a frozen body): a prompt state that no trained parameter reaches (all of
    it when only the final norm trains) needs no backward; ``sp.backward`` used to hand it to autograd and fail
    ("element 1 of tensors does not require grad", found by the fuzzer). The trained parameters get the plain
    gradient."""
    model, gs = model_of("zaya"), groups_of()
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(trained in n)
    try:
        with Float64Inside():
            lp = plain_logprobs(model, gs)[0]
            w = _weights(lp.shape)
            want = _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
            model.zero_grad(set_to_none=True)
            sp.backward(model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=7, prefix_activations=mode)
            got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
        assert want and _grad_error(got, want) <= 1e-9
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(before[n])


def test_refusals_name_the_value_and_the_fix():
    model, gs = model_of("zaya"), groups_of()
    with pytest.raises(ValueError, match=r"max_tokens=5 is below groups\[0\]'s longest completion \(6 tokens\)"):
        sp.logprobs(model, gs, max_tokens=5)
    with pytest.raises(ValueError, match=r"max_tokens=2; expected None or an int >= 3"):
        sp.logprobs(model, gs, max_tokens=2)
    with pytest.raises(ValueError, match="does not take an sp.Tree"):
        sp.logprobs(model, sp.Tree.from_rows([[3, 4, 5], [3, 4, 6]]))
    model.gradient_checkpointing_enable()
    model.train()
    try:
        with pytest.raises(ValueError, match="gradient checkpointing on"):
            sp.backward(model, gs, lambda b: b.logprobs.sum())
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("entry", ["mamba", "falcon_mamba", "jamba", "zamba"])
def test_mamba1_families_stay_refused_because_their_scan_ignores_the_prompts_state(monkeypatch, entry):
    """Mamba (v1) layers (Mamba, Falcon-Mamba, Jamba, Zamba) are refused with the reason, and the reason is real: put
    on the hybrid path anyway, their completions start from a zero recurrent state (the model's own multi-token scan
    takes no initial state) and the log-probs are far from the plain run's."""
    from sharedprefix.model import support as modeling

    model = zoo_model(entry)
    assert model.config.model_type in modeling.HYBRID_REFUSED and not mixers.on_path(
        model.config.model_type, mixers.CACHE
    )
    gs = groups_of()
    with pytest.raises(
        ValueError,
        match=r"mix tokens outside attention.*Mamba \(v1\) selective scan starts every "
        r"multi-token forward from a zero state",
    ):
        sp.logprobs(model, gs)
    monkeypatch.setitem(mixers.FAMILIES, model.config.model_type, mixers.Family(mixers.CACHE))
    with torch.no_grad():
        err = float((sp.logprobs(model, gs).logprobs - plain_logprobs(model, gs)[0]).abs().max())
    assert err > 1e-3, err


def test_recurrent_gemma_stays_refused_with_its_reason(monkeypatch):
    """RecurrentGemma keeps its states on its modules, outside the cache: refused with the reason; put on the hybrid
    path anyway, the prompt's cache holds no state for its recurrent layers and the path refuses it there too."""
    model = zoo_model("recurrent_gemma")
    with pytest.raises(
        ValueError,
        match="mix tokens outside attention.*keeps its convolution and recurrent states on its own modules, "
        "not in the cache",
    ):
        sp.logprobs(model, groups_of())
    monkeypatch.setitem(mixers.FAMILIES, "recurrent_gemma", mixers.Family(mixers.CACHE))
    with pytest.raises(ValueError, match=r"cache layers \[0\] hold no state"):
        sp.logprobs(model, groups_of())


def test_deferred_logprobs_give_the_backward_gradient():
    """``defer=True``: values without a graph, ``sp.backward`` on the hybrid path when autograd reaches them, with the
    incoming gradients as its loss: the gradient of ``sp.backward`` itself under the same budget (relative 1e-9; both
    with Zaya's own float32 parts, since the deferred backward runs where ``Float64Inside`` does not reach; the
    float32 scan's own accuracy is the 2x test above)."""
    model, gs = model_of("zaya"), groups_of()
    w = _weights(reference("zaya+float64", model, gs, Float64Inside)[0].shape)
    model.zero_grad(set_to_none=True)
    sp.backward(model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6)
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    got = _grads(model, lambda: (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum())
    assert _grad_error(got, want) <= 1e-9


def test_deferred_logprobs_refuse_a_backward_after_the_parameters_changed():
    """The cache path's deferred backward recomputes the forward too: an in-place change of a parameter between the
    call and its backward is refused, as plain autograd refuses it, and nothing is accumulated."""
    model, gs = copy.deepcopy(model_of("zaya")), groups_of()
    out = sp.logprobs(model, gs, max_tokens=6, defer=True)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match=r"after 1 of the model's parameters were modified in place .*'model.norm"):
        out.logprobs.sum().backward()
    assert all(p.grad is None for p in model.parameters())


ZOO_HYBRIDS = [  # the other zoo hybrids run on the packed path (test_hybrid_packed.py, _ssm.py, _linear.py)
    "minimax",
    "zaya",
]
# sp.backward in the three prefix modes (the others: "keep", the modes being the same code for every family)
ALL_MODES = {"minimax", "zaya"}


@pytest.mark.slow  # the zoo's hybrids
@pytest.mark.parametrize("entry", ZOO_HYBRIDS)
def test_zoo_hybrids_match_the_plain_forward_and_carry_every_state(entry):
    """The other listed hybrids, built as the zoo builds them but with weights of std 0.2 (states that matter), their
    float32 casts kept float64: log-probs to 1e-9 under a budget that chunks the prompt and splits the completions,
    ``sp.backward``'s gradient to a relative 1e-9 (in the three prefix modes for ``ALL_MODES``), and every kind of
    state the cache carries (K/V where the model has attention layers, conv, recurrent) matters: zeroed, the
    log-probs move far beyond the tolerance."""
    from sharedprefix.model.adapter import ATTENTION_LAYER_TYPES

    model = zoo_model(entry)
    assert mixers.on_path(model.config.model_type, mixers.CACHE)
    gs = groups_of()
    with Float64Inside():
        ref = plain_logprobs(model, gs)[0].detach()
        w = _weights(ref.shape)
        want = _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
        with torch.no_grad():
            assert float((sp.logprobs(model, gs, max_tokens=6).logprobs - ref).abs().max()) <= 1e-9
        runs = [("keep", 6), ("offload", None), ("recompute", 6)] if entry in ALL_MODES else [("keep", 6)]
        for mode, max_tokens in runs:
            sp.backward(
                model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=max_tokens, prefix_activations=mode
            )
            got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            assert _grad_error(got, want) <= 1e-9, (mode, max_tokens, _grad_error(got, want))
        read = cache_run.read_states
        cache = cache_run.HybridRun(model, gs, CallOptions.build()).prompt(gs[0])[0]
        kinds = sorted({name for _, name, _ in cache_run.state_slots(cache)})
        types = model.config.get_text_config().layer_types
        assert set(kinds) & {"conv_states", "recurrent_states", "linear_cache"}, kinds  # a state beside any K/V
        assert "keys" in kinds or not set(types) & ATTENTION_LAYER_TYPES, kinds
        for slot in kinds:
            zeroed = lambda cache, slots, slot=slot: [  # noqa: E731
                torch.zeros_like(t) if name == slot else t for (_, name, _), t in zip(slots, read(cache, slots))
            ]
            cache_run.read_states = zeroed
            try:
                with torch.no_grad():
                    assert float((sp.logprobs(model, gs).logprobs - ref).abs().max()) > 1e-6, slot
            finally:
                cache_run.read_states = read


def test_deferred_logprobs_backward_reads_the_groups_of_the_call():
    """The cache path's deferred backward recomputes the forward from the groups: it reads its own copy of them, made
    at the call, so that an in-place edit of the caller's token ids between the call and the backward (a reused
    buffer) changes nothing, as in a plain run, whose graph holds what its forward read (the backward followed the
    edit: a gradient 1.6 away, relative, silently)."""
    model, gs = model_of("zaya"), groups_of()
    w = _weights(reference("zaya+float64", model, gs, Float64Inside)[0].shape)
    want = _grads(model, lambda: (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum())

    def edited_after_the_call():
        loss = (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum()
        gs[0].prompt[1] = (gs[0].prompt[1] + 1) % model.config.vocab_size
        gs[0].completions[0][0] = (gs[0].completions[0][0] + 1) % model.config.vocab_size
        return loss

    got = _grads(model, edited_after_the_call)
    assert _grad_error(got, want) <= 1e-12
