"""Mamba2-family hybrids on the packed path (``model.mixers.ssm``): Mamba2, Nemotron-H, Falcon-H1, Zamba2, Bamba and
Granite-4 hybrid, against one plain forward per row in float64 (log-probs 1e-9, gradients relative 1e-9).

The tiny models are the zoo's, with weights of std 0.2 (states that matter) and a scan chunk of 4 tokens, so that a
9-token prompt spans three chunks; Falcon-H1 also gets mup multipliers other than 1. The Mamba2 scan (and the gated
norm after it) computes in float32 even in a float64 model: the 1e-9 tests run the plain rows and sharedprefix under
``Float64Inside`` (the same code, float64 inside). Gradient checkpointing and ``defer=True`` recompute inside
autograd's backward, where that mode does not reach: they are held to ``sp.backward`` itself (1e-9, the same float32
code) and to the 2x rule against the float64-inside result, gradient errors at the scale of the largest gradient (as
the zoo measures them: a small gradient that sums float32 terms over every position, such as A_log's, rounds
differently wherever the chunks differ). Controls that must fail prove the comparisons catch a zeroed carried state,
a detached cached state and padding whose step size is not zeroed (the fix reverted). Heavy cases are slow-marked;
the inner loop keeps Nemotron-H (attention, Mamba2, MoE and MLP layers) whole and split, the padding check, the
controls and the refusals.
"""

import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.model import mixers
from sharedprefix.model.mixers import ssm
from sharedprefix.tools.reference import Float64Inside
from support.hybrid import (
    DEEP_ROWS,
    assert_detached_state_caught,
    groups_check,
    groups_of,
    logprob_error,
    ssm_model,
    tree_check,
)
from support.trees import ROW_SPEC, masks, tree_rows

FAMILIES = ["nemotron_h"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("falcon_h1", "mamba2", "zamba2", "bamba", "granitemoehybrid")
]


def _src(model):
    return sys.modules[type(mixers.mixer_modules(model)[0][0]).__module__]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_match_plain_rows_in_one_pass_and_split(family):
    """Every Mamba2 family on the packed path (none on the cache path): three groups in one pass, and a budget that
    cuts the 9-token prompt into a chain and splits its completions; Falcon-H1 in the three modes."""
    model = ssm_model(family)
    assert (
        mixers.on_packed_path(model)
        and not mixers.on_cache_path(model)
        and mixers.FAMILIES[model.config.model_type].path == mixers.PACKED
    )
    assert all(m.chunk_size == 4 for m, _ in mixers.mixer_modules(model))
    gs = groups_of()
    assert len(sp.plan(gs, None).passes) == 1 and sp.plan(gs, 6).splits  # many groups per pass; a split
    runs = [(None, "keep"), (6, "keep")] + ([(6, "offload"), (6, "recompute")] if family == "falcon_h1" else [])
    with Float64Inside():
        groups_check(model, gs, runs)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["falcon_h1", "nemotron_h"])
def test_a_depth_4_tree_under_budgets_that_split_every_depth(family):
    """The depth-5 trie of test_hybrid_packed (system prompt, prompts, completions, a shared second-turn token,
    second turns): whole, under a budget that caches some inner segments (5) and one that caches every inner segment
    of every depth (3), in the three modes."""
    trained = [[t >= 8 for t in range(len(r))] for r in DEEP_ROWS]
    with Float64Inside():
        tree_check(ssm_model(family), DEEP_ROWS, trained, (None, 5, 3), ("keep", "offload", "recompute"))


@pytest.mark.slow
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(spec=ROW_SPEC, budget=st.sampled_from([None, 3, 5, 8]), mode=st.sampled_from(["keep", "offload", "recompute"]))
@pytest.mark.parametrize("family", ["falcon_h1", "bamba"])
def test_random_tries_match_plain_rows(family, spec, budget, mode):
    """Hypothesis tries (depth 1 to 4 and more) with short segments, so that a level pads segments of many lengths
    and a convolution's past inputs span several ancestors, some of them cached."""
    rows = tree_rows(spec)
    with Float64Inside():
        tree_check(ssm_model(family), rows, masks(rows, spec), (budget,), (mode,))


def test_zero_step_padding_is_the_unpadded_scan():
    """The padding ``ssm.scan`` relies on: with dt discretised by ``ssm.discretize`` and padded with 0, the model's
    own scan gives, at the real positions and for the final state, what the unpadded call with dt_bias, softplus and
    a dt_limit gives: bit for bit without padding, to float64 rounding with a segment padded over two more chunks;
    the raw dt padded with 0 (the fix reverted) moves the final state."""
    src = _src(ssm_model("mamba2"))
    g = torch.Generator().manual_seed(0)
    n, T, H, P, N = 7, 13, 4, 3, 5
    x, dt = torch.randn(1, n, H, P, generator=g), torch.randn(1, n, H, generator=g)
    A, B, C = (
        -torch.rand(H, generator=g) - 0.5,
        torch.randn(1, n, 1, N, generator=g),
        torch.randn(1, n, 1, N, generator=g),
    )
    D, bias, init = torch.randn(H, generator=g), torch.randn(H, generator=g), torch.randn(1, H, P, N, generator=g)
    limit = (0.05, 2.0)  # a floor above 0: a pad of 0 passed through this clamp would not stay 0

    def own(x, dt, B, C, **k):
        return src.mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size=4, D=D, initial_states=init, return_final_states=True, **k
        )

    def pad(t):
        return torch.cat([t, t.new_zeros((1, T - n) + t.shape[2:])], 1)

    ref, ref_state = own(x, dt, B, C, dt_bias=bias, dt_softplus=True, dt_limit=limit)
    d, neutral = ssm._neutral_padding(dt, bias, True, limit)
    same, same_state = own(x, d, B, C, **neutral)
    assert torch.equal(same, ref) and torch.equal(same_state, ref_state)
    with Float64Inside():
        x, dt, B, C, D, bias, init, A = (t.double() for t in (x, dt, B, C, D, bias, init, A))
        ref, ref_state = own(x, dt, B, C, dt_bias=bias, dt_softplus=True, dt_limit=limit)
        d, neutral = ssm._neutral_padding(dt, bias, True, limit)
        out, state = own(pad(x), pad(d), pad(B), pad(C), **neutral)
        assert float((out[:, :n] - ref).abs().max()) <= 1e-13 and float((state - ref_state).abs().max()) <= 1e-13
        _, reverted = own(pad(x), pad(dt), pad(B), pad(C), dt_bias=bias, dt_softplus=True, dt_limit=limit)
        assert float((reverted - ref_state).abs().max()) > 1e-3


def _grad_error(got, truth):
    """max |got - truth| over every tensor, relative to the largest gradient (the zoo's measure for float32 parts)."""
    return max(float((got[n] - truth[n]).abs().max()) for n in truth) / max(
        float(t.abs().max()) for t in truth.values()
    )


@pytest.mark.slow
def test_gradient_checkpointing_and_defer():
    """Training mode with non-reentrant gradient checkpointing (``sp.backward`` whole and split, grad-enabled
    ``sp.logprobs``, deferred as checkpointing needs) and ``defer=True`` without it: the gradient of ``sp.backward``
    itself with the model's own float32 scan (relative 1e-9; its exactness in float64 is the tests above), and within
    twice the plain run's own error against the float64-inside plain gradient."""
    model, gs = ssm_model("falcon_h1"), groups_of()
    with Float64Inside():
        truth = plain_logprobs(model, gs)[0].detach()
        w = torch.randn(truth.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        g_truth = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())

    def loss(b):
        return (b.logprobs * w[b.index]).sum()

    def err(g):
        return _grad_error(g, g_truth)

    g_plain = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    want = {b: grads_of(model, lambda b=b: sp.backward(model, gs, loss, max_tokens=b) and None) for b in (None, 6)}
    assert err(g_plain) > 0  # the float32 scan really rounds
    got = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum())
    assert_grads_close(got, want[6], 1e-9)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        runs = {b: grads_of(model, lambda b=b: sp.backward(model, gs, loss, max_tokens=b) and None) for b in (None, 6)}
        deferred = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6).logprobs * w).sum())
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    for b, g in runs.items():
        assert_grads_close(g, want[b], 1e-9)
        assert err(g) <= 2 * err(g_plain)
    assert_grads_close(deferred, want[6], 1e-9)


def test_own_float32_scan_within_twice_the_plain_error():
    """Without ``Float64Inside``: log-probs within twice the plain run's own error against the float64-inside
    result, in one pass and split."""
    model, gs = ssm_model("nemotron_h"), groups_of()
    with Float64Inside():
        truth = plain_logprobs(model, gs)[0].detach()
    plain = float((plain_logprobs(model, gs)[0].detach() - truth).abs().max())
    assert plain > 0
    for budget in (None, 6):
        with torch.no_grad():
            assert float((sp.logprobs(model, gs, max_tokens=budget).logprobs - truth).abs().max()) <= 2 * plain


# -- controls that must fail --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, pytest.param(6, marks=pytest.mark.slow)])
def test_control_a_zeroed_carried_state_is_caught(monkeypatch, budget):
    """A scan that drops the state it is handed (a parent in the row, or one from the cache) is 1000x beyond the
    tolerance."""
    model, gs = ssm_model("falcon_h1"), groups_of()
    src = _src(model)
    own = src.mamba2_chunk_scan
    monkeypatch.setattr(
        src, "mamba2_chunk_scan", lambda *a, initial_states=None, **k: own(*a, initial_states=None, **k)
    )
    with Float64Inside():
        assert logprob_error(model, gs, budget) > 1e-6


def test_control_padding_with_the_raw_step_size_is_caught(monkeypatch):
    """The fix reverted: padded positions keep dt = 0 before the bias and softplus (the model's function then
    decays the state and adds input there), so a short segment of a level hands its children a wrong state."""
    model, gs = ssm_model("falcon_h1"), groups_of()
    monkeypatch.setattr(
        ssm, "_neutral_padding", lambda dt, b, s, lim: (dt, dict(dt_bias=b, dt_softplus=s, dt_limit=lim))
    )
    with Float64Inside():
        assert logprob_error(model, gs, None) > 1e-6


def test_control_a_detached_cached_state_is_caught(monkeypatch):
    """Cached conv tails and scan states read detached: the log-probs stay exact, the gradient that later passes
    send into the prompt through them is lost, and the gradient comparison catches it."""
    model, gs = ssm_model("nemotron_h"), groups_of()
    assert_detached_state_caught(monkeypatch, model, gs)


# -- what is refused ----------------------------------------------------------------------------------------------


def test_the_fused_kernel_shortcut_is_refused(monkeypatch):
    """In training mode the mixers first try ``mamba2_split_conv1d_scan_combined`` (a mamba_ssm kernel that convolves
    and scans the whole row); when it returns a result, the seams are never called: refused, not silently mixed."""
    model, gs = ssm_model("granitemoehybrid"), groups_of()
    src = _src(model)
    monkeypatch.setattr(
        src,
        "mamba2_split_conv1d_scan_combined",
        lambda x, *a, **k: x.new_zeros(x.shape[:-1] + (model.config.hidden_size,)),
    )
    model.train()
    try:
        with pytest.raises(
            ValueError,
            match=r"GraniteMoeHybridMambaLayer ran its forward without calling "
            r"\['causal_conv1d_fn', 'mamba2_chunk_scan'\]",
        ):
            sp.logprobs(model, gs)
    finally:
        model.eval()


def test_a_layer_pattern_whose_mixers_are_not_found_is_refused(monkeypatch):
    """Nemotron-H names its layers in ``layers_block_type`` (from ``hybrid_override_pattern``): its one Mamba layer is
    counted, and a transformers version whose mixer class sharedprefix does not know is refused before any pass."""
    model = ssm_model("nemotron_h")
    assert model.config.layers_block_type.count("linear_attention") == 1 == len(mixers.mixer_modules(model))
    unknown = {
        t: replace(f, mixers={k: v for k, v in f.mixers.items() if k != "Mamba2Mixer"})
        for t, f in mixers.FAMILIES.items()
    }
    monkeypatch.setattr(mixers.families, "FAMILIES", unknown)  # no family's mixers named *Mamba2Mixer
    with pytest.raises(
        ValueError, match=r"NemotronHForCausalLM has 1 layers of types .* but sharedprefix finds 0 mixer modules"
    ):
        sp.logprobs(model, groups_of())
