"""Hybrid models through sharedprefix's verl engine, against verl's own engine (CPU, float32); every test runs on each
family: LFM2 (short convolutions beside attention), LFM2-MoE (the same with mixtures of experts), Qwen3.5's text model
and Qwen3-Next (gated delta-nets beside attention; Qwen3-Next with mixtures of experts).

verl 0.9.1 pins transformers < 5.11; under its 5.10 LFM2 runs its ``nn.Conv1d`` (``causal_conv1d_fn`` is None without
the causal_conv1d package), which the core's packed path hooks (``model.mixers.conv_module``); the gated delta-nets run
their ``nn.Conv1d`` too, and call the delta rule they bound on themselves when built
(``self.chunk_gated_delta_rule``), which ``model.mixers.active`` wraps for the duration of each call.

verl's own engine with ``use_remove_padding=True`` packs the micro-batch's rows into one sequence and tells the
attention where rows start (position ids), but these mixers take no such boundaries (5.10's torch delta rule ignores
the ``cu_seqlens`` it is handed): each row's convolution reads the previous row's last inputs, its recurrence
starts from the previous row's state, and verl's log-probs are wrong (``test_verl_remove_padding_mixes_hybrid_rows``).
The reference is therefore verl's engine with ``use_remove_padding=False`` (padded rows, whose padding the model
zeroes before its mixers); ours runs with ``use_remove_padding=True``, the setting verl users run (a packed row per
group, each segment after its own path).

The gated delta rule runs in float32 inside transformers even in a float64 model: their float64 reference runs
under ``Float64Inside``.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import pytest
import torch

if os.environ.get("SHAREDPREFIX_REQUIRE_VERL"):
    import verl  # noqa: F401
else:
    pytest.importorskip("verl")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers as tf  # noqa: E402
import verl_cpu  # noqa: E402, F401  (verl's CPU platform, before verl's engine modules load)
from verl_support import (  # noqa: E402
    VOCAB,
    FSDPEngineWithLMHead,
    Spec,
    build,
    infer,
    loss_fn,
    masked_rel,
    reference,
    rel,
    responses_of,
    rl_batch,
    train,
)

from sharedprefix.integrations.verl import ENV_MAX_TOKENS, SharedPrefixFSDPEngine  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402

pytestmark = pytest.mark.slow  # verl's engines, in their own environment (scripts/dev test-verl), as test_verl.py

AGREE = 1e-5
TEMPERATURE = 0.7
SPEC = Spec(prompts=[14, 20, 9], responses=[[5, 8, 3, 6], [7, 2, 8, 4], [6, 6, 1, 8]])
ROWS = 12


DELTA = ("qwen3_5_text", "qwen3_next")  # gated delta-nets: the delta rule runs in float32 inside transformers
FAMILIES = ["lfm2", "lfm2_moe", *DELTA]


def save_lfm2(path: str, family: str = "lfm2") -> str:
    """A tiny random LFM2 (conv, attention, conv; kernel 3) saved with save_pretrained; ``family="lfm2_moe"``: LFM2-MoE,
    its first layer's MLP dense and the other two mixtures of 4 experts (top 2, with its expert bias). The gated
    delta-nets: ``"qwen3_5_text"`` (Qwen3.5's text model) and ``"qwen3_next"`` (the same mixer, mixtures of 4 experts
    with a shared expert), a delta-net layer (conv kernel 4) then an attention layer."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        tie_word_embeddings=False,
    )
    delta = dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    if family == "lfm2_moe":
        cfg = tf.Lfm2MoeConfig(
            **common,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            architectures=["Lfm2MoeForCausalLM"],
        )
    elif family == "qwen3_5_text":
        common = {k: v for k, v in common.items() if k != "conv_L_cache"}
        cfg = tf.Qwen3_5TextConfig(**{**common, **delta}, architectures=["Qwen3_5ForCausalLM"])
    elif family == "qwen3_next":
        common = {k: v for k, v in common.items() if k != "conv_L_cache"}
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        cfg = tf.Qwen3NextConfig(**{**common, **delta}, **moe, architectures=["Qwen3NextForCausalLM"])
    else:
        cfg = tf.Lfm2Config(**common, block_auto_adjust_ff_dim=False, architectures=["Lfm2ForCausalLM"])
    torch.manual_seed(0)
    model = getattr(tf, cfg.architectures[0])(cfg)
    with torch.no_grad():  # a less uniform distribution than the tiny init gives, so that clipping and KL bite
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def path(request, tmp_path_factory):
    return save_lfm2(str(tmp_path_factory.mktemp(f"verl_{request.param}")), request.param)


@pytest.fixture(scope="module")
def engines(process_group, path):
    return build(FSDPEngineWithLMHead, path, remove_padding=False), build(SharedPrefixFSDPEngine, path)


def _reference(path, td, loss=None):
    """The float64 yardstick; for a gated delta-net under ``Float64Inside`` (transformers casts its delta rule and
    decay to float32 even in a float64 model, so a plain float64 forward is only float32-accurate there)."""
    with Float64Inside() if tf.AutoConfig.from_pretrained(path).model_type in DELTA else nullcontext():
        return reference(path, td, loss, temperature=TEMPERATURE)


def _make(remove_padding=True):
    return rl_batch(SPEC, temperature=TEMPERATURE, micro=4, remove_padding=remove_padding)


def _resp(td):
    return td["attention_mask"][:, -td["responses"].shape[1] :].bool()


def _errors(theirs, ours, path):
    td = _make()
    ref_lp, ref_ent, _ = _reference(path, td)
    out = {}
    for key, ref in (("log_probs", ref_lp), ("entropy", ref_ent)):
        a = responses_of(theirs["model_output"][key], td)
        b = responses_of(ours["model_output"][key], td)
        out[key] = (masked_rel(b, a, _resp(td)), masked_rel(b, ref, _resp(td)), masked_rel(a, ref, _resp(td)))
    print({k: [f"{x:.2g}" for x in v] for k, v in out.items()})  # ours vs verl, ours vs float64, verl vs float64
    return out


def test_verl_remove_padding_mixes_hybrid_rows(process_group, engines, path):
    """verl's engine with use_remove_padding=True: its convolution (and delta rule) reads across the packed rows (each
    row's first tokens after the previous row's last ones), which puts it far beyond float32 rounding of the float64
    rows, where verl's padded engine (the reference here) stays."""
    packed = build(FSDPEngineWithLMHead, path, remove_padding=True)
    td = _make()
    ref_lp, _, _ = _reference(path, td)
    err = {
        name: masked_rel(responses_of(infer(e, _make(rp))["model_output"]["log_probs"], td), ref_lp, _resp(td))
        for name, e, rp in (("remove_padding", packed, True), ("padded", engines[0], False))
    }
    print({k: f"{v:.2g}" for k, v in err.items()})
    assert err["remove_padding"] > 20 * err["padded"]


def test_infer_matches_verl(engines, path):
    ev, es = engines
    errs = _errors(infer(ev, _make(False)), infer(es, _make()), path)
    for key, factor in (("log_probs", 2.0), ("entropy", 4.0)):
        ours_verl, ours_ref, verl_ref = errs[key]
        assert ours_verl <= AGREE, key
        assert ours_ref <= factor * verl_ref, key


def _of_largest(a: dict, b: dict) -> float:
    """Largest |a - b| over the parameters, relative to the largest |b| of the model."""
    top = max(float(g.double().abs().max()) for g in b.values())
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in b) / top


@pytest.mark.parametrize("budget", [None, 24], ids=["one_pass", "split"])
def test_gradients_match_verl(process_group, engines, path, monkeypatch, budget):
    """verl's clip + KL + entropy loss; under SHAREDPREFIX_MAX_TOKENS=24 each group's prompt runs once and its
    completions in several passes, reading the cached conv tails (and delta-rule states) and K/V.

    Gradients against float64 by the 2x rule, both per tensor (each relative to its own largest entry, the worst
    tensor) and at the scale of the model's largest gradient. Against verl's engine: 1e-5 at the largest gradient's
    scale; per tensor too for LFM2, not for Qwen3-Next, whose ``dt_bias`` / ``A_log`` gradients (small sums with
    cancellation through the float32 decay) verl's padded engine computes 5.9e-5 (``dt_bias``) from float64, ours
    1.3e-5: the 5.6e-5 between the two is verl's own float32 rounding."""
    ev, es = engines
    if budget is not None:
        monkeypatch.setenv(ENV_MAX_TOKENS, str(budget))
        es = build(SharedPrefixFSDPEngine, path)
        monkeypatch.delenv(ENV_MAX_TOKENS)
        assert es.sp_max_tokens == budget
        errs = _errors(infer(ev, _make(False)), infer(es, _make()), path)
        assert errs["log_probs"][0] <= AGREE and errs["entropy"][0] <= AGREE
    lf = loss_fn("clip_kl_entropy", ROWS)
    (out_v, g_v), (out_s, g_s) = train(ev, _make(False), lf), train(es, _make(), lf)
    _, _, g_ref = _reference(path, _make(), lf)
    pairs = ((g_s, g_v), (g_s, g_ref), (g_v, g_ref))  # ours vs verl, ours vs float64, verl vs float64
    print(
        "grads per tensor:",
        " ".join(f"{rel(a, b):.2g}" for a, b in pairs),
        "at the largest:",
        " ".join(f"{_of_largest(a, b):.2g}" for a, b in pairs),
    )
    for n in g_ref:  # each tensor relative to its own largest entry
        print(f"  {n}:", " ".join(f"{rel({n: a[n]}, {n: b[n]}):.2g}" for a, b in pairs))
    assert min(float(g.abs().max()) for g in g_ref.values()) > 0
    assert rel(g_s, g_ref) <= 2.0 * rel(g_v, g_ref)
    assert _of_largest(g_s, g_ref) <= 2.0 * _of_largest(g_v, g_ref)
    assert _of_largest(g_s, g_v) <= AGREE
    if tf.AutoConfig.from_pretrained(path).model_type != "qwen3_next":
        assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)


def test_qwen3_next_gap_to_verl_is_the_float32_delta_rule(process_group, tmp_path, monkeypatch):
    """Where the gap between verl's Qwen3-Next gradients and ours comes from: with the modeling module's delta rule
    computed in float64 inside (inputs upcast, ``Float64Inside``, outputs cast back to float32; final states kept
    float64) in both engines, built after the patch so that each delta-net binds it, ``dt_bias`` / ``A_log`` agree
    per tensor far below 1e-5 instead of 5.6e-5 (everything else unchanged: float32 model, verl's padded engine)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as src

    own = src.torch_chunk_gated_delta_rule

    def float64_rule(query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        up = [x.double() for x in (query, key, value, g, beta)]
        with Float64Inside():
            out, state = own(
                *up[:3],
                g=up[3],
                beta=up[4],
                initial_state=None if initial_state is None else initial_state.double(),
                **kwargs,
            )
        return out.to(query.dtype), state

    monkeypatch.setattr(src, "torch_chunk_gated_delta_rule", float64_rule)
    path = save_lfm2(str(tmp_path), "qwen3_next")
    ev, es = build(FSDPEngineWithLMHead, path, remove_padding=False), build(SharedPrefixFSDPEngine, path)
    assert all(
        vars(m)["chunk_gated_delta_rule"] is float64_rule
        for m in ev.module.modules()
        if type(m).__name__.endswith("GatedDeltaNet")
    )
    lf = loss_fn("clip_kl_entropy", ROWS)
    (_, g_v), (_, g_s) = train(ev, _make(False), lf), train(es, _make(), lf)
    delta = [n for n in g_v if n.endswith(("dt_bias", "A_log"))]
    errs = {n: rel({n: g_s[n]}, {n: g_v[n]}) for n in delta}
    print("float64 delta rule, ours vs verl:", {n: f"{e:.2g}" for n, e in errs.items()}, f"all {rel(g_s, g_v):.2g}")
    assert len(delta) == 2 and max(errs.values()) <= AGREE / 5
