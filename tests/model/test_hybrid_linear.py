"""The hybrids that left the cache path for the packed path (LFM3's short convolutions, Lara-mini's gated delta-net,
Kimi Linear's and Bailing-hybrid's Kimi delta attention, ``model.mixers.kda``), and the two that stay on it because
their token mixing has no seam (MiniMax, Zaya), against one plain forward per row in float64 (log-probs 1e-9, gradients
relative 1e-9).

The delta rules cast to float32 inside a float64 model: those runs go under ``Float64Inside`` (the same code, float64
inside). Tiny configs of 3 layers mixing recurrent or convolution layers with attention, weights of std 0.2 (states
that matter). Controls that must fail: a zeroed carried KDA state, a detached cached KDA state, a pad that is not
neutral for the model's own KDA function.
"""

import contextlib
import sys

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import grads_of, plain_logprobs
from sharedprefix.model import mixers
from sharedprefix.tools.reference import Float64Inside
from support.hybrid import (
    DEEP_ROWS,
    assert_detached_state_caught,
    groups_check,
    groups_of,
    linear_model,
    tree_check,
    zoo_model,
)
from support.trees import ROW_SPEC, masks, tree_rows

KDA = "kimi_linear"
# KDA's torch chunk loop and the delta nets' dominate; LFM3 and two KDA checks stay fast
FAMILIES = ["lfm3"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("lara_mini", KDA, "bailing_hybrid")]


def _inside(family):
    return contextlib.nullcontext() if family == "lfm3" else Float64Inside()  # LFM3: convolutions only, no casts


def _kda_module(model):
    return sys.modules[type(mixers.mixer_modules(model)[0][0]).__module__]


@pytest.mark.parametrize("family", FAMILIES)
def test_moved_families_match_plain_rows_in_one_pass_and_split(family):
    """Each moved family on the packed path (not on the cache path): three groups in one pass, and a budget that cuts
    the 9-token prompt into a chain and splits its completions, in the three modes (keep only for the second KDA
    family, the modes being the same code)."""
    model = linear_model(family)
    assert (
        mixers.on_packed_path(model)
        and not mixers.on_cache_path(model)
        and mixers.FAMILIES[family].path == mixers.PACKED
    )
    assert {str(t) for t in model.config.layer_types} & mixers.PACKED_LAYER_TYPES and len(model.config.layer_types) == 3
    gs = groups_of()
    assert len(sp.plan(gs, None).passes) == 1 and sp.plan(gs, 6).splits  # many groups per pass; a split
    modes = ["keep"] if family == "bailing_hybrid" else ["keep", "offload", "recompute"]
    with _inside(family):
        groups_check(model, gs, [(None, "keep")] + [(6, m) for m in modes])


@pytest.mark.slow
@pytest.mark.parametrize("family", [KDA, "lfm3"])
def test_a_depth_4_tree_under_budgets_that_split_every_depth(family):
    """The depth-5 trie of test_hybrid_packed (system prompt, prompts, completions, second turns): whole, under a
    budget that caches some inner segments (5) and one that caches every inner segment of every depth (3)."""
    model = linear_model(family)
    trained = [[t >= 8 for t in range(len(r))] for r in DEEP_ROWS]
    modes = ("keep", "offload", "recompute") if family == "lfm3" else ("keep", "recompute")
    with _inside(family):
        tree_check(model, DEEP_ROWS, trained, (None, 5, 3), modes)


@pytest.mark.slow
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(spec=ROW_SPEC, budget=st.sampled_from([None, 3, 5, 8]), mode=st.sampled_from(["keep", "offload", "recompute"]))
@pytest.mark.parametrize("family", [KDA, "lara_mini"])
def test_random_tries_match_plain_rows(family, spec, budget, mode):
    """Hypothesis tries (depth 1 to 4 and more) with short segments: a convolution's K past inputs span several
    ancestors, some cached, and each scan continues its parent's state from the row or the cache."""
    rows = tree_rows(spec)
    with _inside(family):
        tree_check(linear_model(family), rows, masks(rows, spec), (budget,), (mode,))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm3", KDA])
def test_gradient_checkpointing_and_defer(family):
    """Non-reentrant gradient checkpointing (split ``sp.backward`` and grad-enabled ``sp.logprobs``) and ``defer=True``
    give the plain gradient: LFM3 to a relative 1e-9 (its convolutions compute in float64); Kimi Linear, whose KDA runs
    in float32 where ``Float64Inside`` does not reach (recomputed inside autograd's backward), within twice the plain
    float32 run's own error against the float64-inside gradient."""

    def err(g, truth):
        return max(float((g[n] - truth[n]).abs().max() / truth[n].abs().max().clamp_min(1e-30)) for n in truth)

    model, gs = linear_model(family), groups_of()
    with _inside(family):
        ref = plain_logprobs(model, gs)[0].detach()
        w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        truth = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    tol = (
        1e-9 if family == "lfm3" else 2 * err(grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum()), truth)
    )
    assert tol > 0  # (KDA: the float32 rule really rounds)
    got = grads_of(model, lambda: (sp.logprobs(model, gs, max_tokens=6, defer=True).logprobs * w).sum())
    assert err(got, truth) <= tol, ("defer", err(got, truth), tol)
    runs = {
        "backward": lambda: sp.backward(model, gs, lambda x: (x.logprobs * w[x.index]).sum(), max_tokens=6) and None,
        "logprobs": lambda: (sp.logprobs(model, gs, max_tokens=6).logprobs * w).sum(),
    }
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        for name, run in runs.items():
            got = grads_of(model, run)
            assert err(got, truth) <= tol, (name, err(got, truth), tol)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


# -- KDA: its padding, and controls that must fail ------------------------------------------------------------------


@pytest.mark.parametrize("n, pad", [(5, 1), (5, 7), (61, 6)])  # 61 + 6: the pads cross the model's 64-token chunk
def test_zero_padding_is_neutral_for_the_models_own_kda(n, pad):
    """The pads the KDA wrapper appends (zero q, k, v, g and beta) leave the model's own function's outputs on the real
    tokens and its final state as they are without them, from a zero or a given initial state; a pad with a nonzero
    decay (the control) changes the state."""
    fn = _kda_module(linear_model(KDA)).chunk_kimi_delta_attention
    gen = torch.Generator().manual_seed(n + pad)
    H, D = 2, 4

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    q, k, v = rnd(1, n, H, D), rnd(1, n, H, D), rnd(1, n, H, D)
    g, beta = (
        -torch.rand(1, n, H, D, dtype=torch.float64, generator=gen),
        torch.rand(1, n, H, dtype=torch.float64, generator=gen),
    )
    init = rnd(1, H, D, D)

    def padded(t, value=0.0):
        return torch.cat([t, torch.full((1, pad) + t.shape[2:], value, dtype=t.dtype)], 1)

    with Float64Inside():
        for start in (None, init):
            o, s = fn(
                q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            po, ps = fn(
                *map(padded, (q, k, v)),
                g=padded(g),
                beta=padded(beta),
                initial_state=start,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            assert float((po[:, :n] - o).abs().max()) <= 1e-12 and float((ps - s).abs().max()) <= 1e-12
            _, bad = fn(
                *map(padded, (q, k, v)),
                g=padded(g, -1.0),
                beta=padded(beta),
                initial_state=start,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            assert float((bad - s).abs().max()) > 1e-3 or start is None  # decays a nonzero state; a zero one stays 0
    assert float(s.abs().max()) > 1e-3  # (the state after a given initial state is not zero)


def _logprob_error(model, gs, budget):
    ref = plain_logprobs(model, gs)[0].detach()
    with torch.no_grad():
        return float((sp.logprobs(model, gs, max_tokens=budget).logprobs - ref).abs().max())


@pytest.mark.parametrize("budget", [None, pytest.param(6, marks=pytest.mark.slow)])
def test_control_a_zeroed_carried_kda_state_is_caught(monkeypatch, budget):
    """A KDA that drops the state it is handed (the parent's, from the row or the cache) is 1000x beyond tolerance."""
    model, gs = linear_model(KDA), groups_of()
    src = _kda_module(model)
    own = src.chunk_kimi_delta_attention
    with Float64Inside():
        assert _logprob_error(model, gs, budget) <= 1e-9
    monkeypatch.setattr(
        src, "chunk_kimi_delta_attention", lambda *a, initial_state=None, **k: own(*a, initial_state=None, **k)
    )
    with Float64Inside():
        assert _logprob_error(model, gs, budget) > 1e-6


@pytest.mark.slow
def test_control_a_detached_cached_kda_state_is_caught(monkeypatch):
    """Cached KDA states and conv tails read detached: the log-probs stay exact, the gradient the later passes send
    into the prompt through them is lost, and the gradient comparison catches it."""
    model, gs = linear_model(KDA), groups_of()
    assert_detached_state_caught(monkeypatch, model, gs)


# -- MiniMax and Zaya: no seam, the cache path, and every refusal says why ------------------------------------------


@pytest.mark.parametrize("entry", [t for t in mixers.model_types(mixers.CACHE) if mixers.FAMILIES[t].inline])
def test_inline_mixers_stay_on_the_cache_path_and_every_refusal_says_why(monkeypatch, entry):
    """MiniMax's lightning attention and Zaya's CCA convolutions are computed inline in their modules' forwards: no
    function to wrap, so they stay on the cache path, and its refusals of trees, checkpointing, prompt_inputs and
    FSDP2 each say so (the model, the module, and that the packed path cannot reach it)."""
    from sharedprefix.schedule.cache_path import calls

    model, gs = zoo_model(entry), groups_of()
    assert mixers.on_cache_path(model) and not mixers.on_packed_path(model)
    module, _ = mixers.FAMILIES[entry].inline or ("", "")
    why = rf"{module}.*computed inline in its forward.*no function sharedprefix can wrap.*packed path.*cannot reach it"
    with pytest.raises(ValueError, match=r"does not take an sp\.Tree.*" + why):
        sp.logprobs(model, sp.Tree.from_rows([[3, 4, 5], [3, 4, 6]]))
    with pytest.raises(ValueError, match=r"prompt_inputs.*" + why):
        sp.logprobs(model, [sp.Group([3, 4, 5], [[6, 7]], prompt_inputs={"pixel_values": torch.zeros(1, 3)})])
    model.train()
    model.gradient_checkpointing_enable()
    try:
        with pytest.raises(ValueError, match=r"gradient checkpointing on.*" + why):
            sp.backward(model, gs, lambda b: b.logprobs.sum())
    finally:
        model.gradient_checkpointing_disable()
        model.eval()

    from sharedprefix.parallel.engines.fsdp2 import FSDP2

    monkeypatch.setattr(calls, "detect", lambda *a: FSDP2(model))  # the engine of an FSDP2 model, without processes
    with pytest.raises(ValueError, match=r"sharded with FSDP2.*" + why):
        sp.logprobs(model, gs)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_the_hybrid_tree_benchmark_runs_and_counts_tokens():
    """``sharedprefix bench --hybrid --tree`` on a tiny agentic shape: each run computes the tokens its layout implies
    (the tree: every segment once; the cache path: each group's prompt, system prompt included; plain: every row)."""
    from sharedprefix.tools import bench_hybrid

    shape = dict(system=16, prompts=2, prompt_len=4, G=2, completion=3)
    lines = bench_hybrid.tree(layers=4, max_tokens=64, plain_sample=1, **shape)  # the tree fits one pass
    text = "\n".join(lines)
    assert "tokens computed      36  passes 1" in text  # 16 + 2 * 4 + 2 * 2 * 3
    assert "tokens computed      52  passes 4" in text  # 2 * (20 + 2 * 3)
    assert "tokens computed      92  microbatches 2 of 2 row(s) (1 timed, the sum scaled by 2)" in text  # 4 * 23
    assert "ratio of tokens computed 2.56x" in text and "(target >= 0.9)" in text
    figures = bench_hybrid.tree_figures(lines)  # what gpu-check reads of this benchmark on a GPU
    assert set(figures) == {"vs_tokens", "vs_flops", "flops_vs_tokens"}
    assert 0 < figures["flops_vs_tokens"] < 1  # the LM head and attention do not shrink with the tokens


def test_trl_refuses_an_inline_mixer_under_checkpointing_with_the_reason(tmp_path):
    """The TRL trainer's refusal of gradient checkpointing (TRL's default) for a cache-path hybrid says, for MiniMax,
    that its lightning attention is computed inline with nothing to wrap; the fix it names lets the trainer be built."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from sharedprefix.recipes.grpo.tasks import build_tokenizer
    from support.grpo import build_trainer, tiny_for_tokenizer

    tok = build_tokenizer()
    model = tiny_for_tokenizer("minimax", tok, transformers.MiniMaxForCausalLM)
    with pytest.raises(
        ValueError, match=r"Set gradient_checkpointing=False.*MiniMaxLightningAttention.*computed inline"
    ):
        build_trainer(model, tok, tmp_path)
    # (MiniMax is an MoE)
    assert build_trainer(model, tok, tmp_path, gradient_checkpointing=False, router_aux_loss_coef=0.0)
