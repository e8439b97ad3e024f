"""Hybrids on the packed path (``model.mixers``): gated delta-nets and short convolutions driven from the segment tree,
against one plain forward per row in float64 (log-probs 1e-9, gradients relative 1e-9).

The gated delta rule casts to float32 even in a float64 model: those tests run the plain rows and sharedprefix under
``Float64Inside`` (the same code, float64 inside); the model's own float32 rule is held to the 2x rule. Controls that
must fail prove the comparisons catch a zeroed carried state, a convolution reading a sibling's inputs and a detached
cached state.
"""

import contextlib
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.model import mixers
from sharedprefix.tools.reference import Float64Inside
from support.hybrid import (
    COMMON,
    CONFIGS,
    DEEP_ROWS,
    assert_detached_state_caught,
    groups_check,
    groups_of,
    logprob_error,
    model_of,
    tree_check,
    zoo_model,
)
from support.trees import ROW_SPEC, masks, tree_rows

DELTA = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"}  # gated delta rule: float32 inside
# LFM2 and Qwen3-Next (one conv family, one delta-net family) stay in the inner loop
FAMILIES = ["lfm2", "qwen3_next"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("lfm2_moe", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
]


def _model(family):
    return model_of(family) if family in ("lfm2", "qwen3_next") else zoo_model(family)


def _inside(family):
    return Float64Inside() if family in DELTA else contextlib.nullcontext()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_families_match_plain_rows_in_one_pass_and_split(family):
    """Every family on the packed path (none on the cache path): three groups in one pass, and a budget that cuts the
    9-token prompt into a chain and splits its completions ("keep"; LFM2 also "offload" and "recompute", the modes being
    the same code for every family and run on Qwen3-Next by the tree tests)."""
    model = _model(family)
    assert (
        mixers.on_packed_path(model)
        and not mixers.on_cache_path(model)
        and mixers.FAMILIES[model.config.model_type].path == mixers.PACKED
    )
    gs = groups_of()
    assert len(sp.plan(gs, None).passes) == 1 and sp.plan(gs, 6).splits  # many groups per pass; a split
    runs = [(None, "keep"), (6, "keep")] + ([(6, "offload"), (6, "recompute")] if family == "lfm2" else [])
    with _inside(family):
        groups_check(model, gs, runs)


@pytest.mark.parametrize("family", ["lfm2", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_a_depth_4_tree_under_budgets_that_split_every_depth(family):
    """A trie of depth 5 (system prompt, prompts, completions, a shared second-turn token, second turns): whole, under
    a budget that caches some inner segments (5), and one that caches every inner segment of every depth (3), each
    depth read from the cache by the next, in the three modes."""
    model = _model(family)
    tree = sp.Tree.from_rows(DEEP_ROWS)
    whole = sp.plan(tree, None).tree
    depth = max(len(whole.ancestors(s.id)) for s in whole.segments) + 1
    assert depth >= 4
    p = sp.plan(tree, 3)  # (the 8-token system prompt becomes a chain of three segments)
    cached = {s for step in p.steps if isinstance(step, sp.schedule.PrefixBackward) for s in step.segments}
    assert cached == {s.parent for s in p.tree.segments if s.parent is not None}  # every inner segment, every depth
    assert {len(p.tree.ancestors(s)) for s in cached} == set(
        range(max(len(p.tree.ancestors(s.id)) for s in p.tree.segments))
    )
    trained = [[t >= 8 for t in range(len(r))] for r in DEEP_ROWS]
    modes = ("keep", "offload", "recompute") if family == "lfm2" else ("keep", "recompute")
    with _inside(family):
        tree_check(model, DEEP_ROWS, trained, (None, 5, 3), modes)


@pytest.mark.slow
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(spec=ROW_SPEC, budget=st.sampled_from([None, 3, 5, 8]), mode=st.sampled_from(["keep", "offload", "recompute"]))
@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_random_tries_match_plain_rows(family, spec, budget, mode):
    """Hypothesis tries (depth 1 to 4 and more: rows continuing cuts of earlier rows) with short segments, so that a
    convolution's K past inputs span several ancestors, some of them cached."""
    rows = tree_rows(spec)
    with _inside(family):
        tree_check(_model(family), rows, masks(rows, spec), (budget,), (mode,))


def test_gradient_checkpointing_and_defer():
    """Training mode with non-reentrant gradient checkpointing: ``sp.backward`` split, and grad-enabled ``sp.logprobs``
    (deferred, as checkpointing needs), give the plain gradient; ``defer=True`` likewise without checkpointing. (LFM2:
    both recompute forwards inside autograd's backward, where ``Float64Inside`` does not reach; Qwen3-Next's float32
    delta rule under checkpointing is held to the 2x rule below.)"""
    model, gs = _model("lfm2"), groups_of()
    ref = plain_logprobs(model, gs)[0].detach()
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    got = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum())
    assert_grads_close(got, want, 1e-9)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        for budget in (None, 6):
            got = grads_of(
                model,
                lambda b=budget: (
                    sp.backward(model, gs, lambda x: (x.logprobs * w[x.index]).sum(), max_tokens=b) and None
                ),
            )
            assert_grads_close(got, want, 1e-9)
        got = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6).logprobs * w).sum())
        assert_grads_close(got, want, 1e-9)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


@pytest.mark.slow
def test_own_float32_delta_rule_within_twice_the_plain_error():
    """Without ``Float64Inside`` the delta rule runs in float32: log-probs and gradients within twice the plain run's
    own error against the float64-inside result, split into a chain and across passes."""
    model, gs = _model("qwen3_next"), groups_of()
    with Float64Inside():
        truth = plain_logprobs(model, gs)[0].detach()
        w = torch.randn(truth.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        g_truth = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    plain = plain_logprobs(model, gs)[0].detach()
    with torch.no_grad():
        ours = sp.logprobs(model, gs, max_tokens=6).logprobs
    assert float((plain - truth).abs().max()) > 0  # the float32 rule really rounds
    assert float((ours - truth).abs().max()) <= 2 * float((plain - truth).abs().max())

    def err(g):
        return max(float((g[n] - g_truth[n]).abs().max() / g_truth[n].abs().max().clamp_min(1e-30)) for n in g_truth)

    g_plain = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    g_ours = grads_of(
        model, lambda: sp.backward(model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6) and None
    )
    assert err(g_ours) <= 2 * err(g_plain)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:  # checkpointed: the delta rule recomputed in backward, split and deferred
        g_ckpt = grads_of(
            model, lambda: sp.backward(model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6) and None
        )
        g_defer = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6).logprobs * w).sum())
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert err(g_ckpt) <= 2 * err(g_plain) and err(g_defer) <= 2 * err(g_plain)


# -- controls that must fail --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, 6])
def test_control_a_zeroed_carried_state_is_caught(monkeypatch, budget):
    """A delta rule that drops the state it is handed (in the row or from the cache) is 1000x beyond the tolerance."""
    model, gs = _model("qwen3_next"), groups_of()
    src = sys.modules[type(mixers.mixer_modules(model)[0][0]).__module__]
    own = src.torch_chunk_gated_delta_rule
    monkeypatch.setattr(
        src, "torch_chunk_gated_delta_rule", lambda *a, initial_state=None, **k: own(*a, initial_state=None, **k)
    )
    with Float64Inside():
        assert logprob_error(model, gs, budget) > 1e-6


def test_control_a_convolution_that_reads_a_siblings_inputs_is_caught(monkeypatch):
    """The model's own convolution over the packed row (each segment after the row's previous tokens, a sibling's or
    another group's, instead of its path's) is far beyond the tolerance."""
    model, gs = _model("lfm2"), groups_of()
    whole_row = lambda own, state, slot, first, x, *a, **k: own(x, *a, **k)  # noqa: E731
    monkeypatch.setitem(mixers.KINDS, "conv", replace(mixers.KINDS["conv"], packed=whole_row))
    assert logprob_error(model, gs, None) > 1e-6


def test_control_a_detached_cached_state_is_caught(monkeypatch):
    """Cached conv tails and recurrent states read detached: the log-probs stay exact, the gradient that the later
    passes send into the prompt through them is lost, and the gradient comparison catches it."""
    model, gs = _model("qwen3_next"), groups_of()
    assert_detached_state_caught(monkeypatch, model, gs)


# -- what is refused ----------------------------------------------------------------------------------------------


def test_a_mixer_whose_seam_is_missing_is_refused(monkeypatch):
    model = _model("lfm2")
    src = sys.modules[type(mixers.mixer_modules(model)[0][0]).__module__]
    monkeypatch.delattr(src, "causal_conv1d_fn")
    for m, _ in mixers.mixer_modules(model):  # nor a Conv1d the module seam takes (``model.mixers.conv_module``)
        monkeypatch.setattr(m.conv, "padding", (0,))
    with pytest.raises(
        ValueError, match=r"Lfm2ForCausalLM: Lfm2ShortConv's modeling module .* has no \['causal_conv1d_fn'\]"
    ):
        sp.logprobs(model, groups_of())


def test_a_mixer_that_bypasses_its_seam_is_refused(monkeypatch):
    """A mixer forward that never calls the wrapped function (another kernel) is refused, not silently mixed."""
    model = _model("lfm2")
    src = sys.modules[type(mixers.mixer_modules(model)[0][0]).__module__]
    own = src.causal_conv1d_fn
    monkeypatch.setattr(src, "causal_conv1d_fn", own)  # restored after the test
    # wrap a function not called
    monkeypatch.setitem(mixers.KINDS, "conv", replace(mixers.KINDS["conv"], attribute="causal_conv1d_update"))
    with pytest.raises(ValueError, match=r"Lfm2ShortConv ran its forward without calling \['causal_conv1d_update'\]"):
        sp.logprobs(model, groups_of())


@pytest.mark.parametrize("family, kind", [("lfm2", "conv"), ("qwen3_next", "linear_attention")])
def test_a_config_without_attention_layers_runs_exactly(family, kind):
    """Every layer recurrent or convolutional (no attention layer: the cache path failed inside transformers with
    "get_seq_length can only be called on Attention layers"): exact on the packed path, one pass and split."""
    import transformers

    from sharedprefix.tools.zoo.configs import float64_norms

    cfg_cls, model_cls, extra = CONFIGS[family]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **dict(extra, layer_types=[kind] * extra["num_hidden_layers"]))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)._from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval()
    model.config._experts_implementation = "eager"
    float64_norms(model)
    with _inside(family):
        groups_check(model, groups_of(), [(None, "keep"), (6, "keep")])


@pytest.mark.parametrize("budget, mode", [(None, "keep"), pytest.param(16, "recompute", marks=pytest.mark.slow)])
def test_qwen3_5_with_images(budget, mode):
    """Qwen3.5 as a vision-language model: ``prompt_inputs`` (images) on the packed path, the vision tower trained
    through the shared prompt, in one pass and with the first group's prompt cached."""
    from helpers import assert_matches_plain_rows
    from support.vl import MROPE_GROUPS, plain_mrope, qwen3_5_vl

    model = qwen3_5_vl()
    assert mixers.on_packed_path(model)
    with Float64Inside():
        got = assert_matches_plain_rows(model, MROPE_GROUPS(), budget, mode, plain=plain_mrope)
    assert any("visual" in n for n in got)


def test_a_packed_pass_outside_the_mixers_context_is_refused():
    """A pass run outside ``mixers.active`` (a caller that skips ``schedule.rounds``) would let the model's own
    convolution read across the row: refused."""
    from sharedprefix.schedule.call import make_plan
    from sharedprefix.schedule.options import CallOptions
    from sharedprefix.schedule.setup import start

    model = _model("lfm2")
    cp = make_plan(model, groups_of(), CallOptions())
    run, _ = start(model, cp, CallOptions(), leaves=False)
    with pytest.raises(RuntimeError, match=r"ran outside model\.mixers\.active"):
        run.run_pass(cp.plan.passes[0])
