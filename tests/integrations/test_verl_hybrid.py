"""Hybrid models (LFM2: short convolutions beside attention; LFM2-MoE: the same with mixtures of experts) through
sharedprefix's verl engine, against verl's own engine (CPU, float32); every test runs on both.

verl 0.9.1 pins transformers < 5.11; under its 5.10 LFM2 runs its ``nn.Conv1d`` (``causal_conv1d_fn`` is None without
the causal_conv1d package), which the core's packed path hooks (``model.mixers_conv``).

verl's own engine with ``use_remove_padding=True`` packs the micro-batch's rows into one sequence and tells the
attention where rows start (position ids), but LFM2's convolution takes no such boundaries: each row's first K = 2
tokens read the previous row's last inputs, and verl's log-probs are wrong
(``test_verl_remove_padding_mixes_lfm2_rows``). The reference is therefore verl's engine with
``use_remove_padding=False`` (padded rows, whose padding the model zeroes before its convolution); ours runs with
``use_remove_padding=True``, the setting verl users run (a packed row per group, each segment after its own path).
"""

from __future__ import annotations

import os
import sys

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

pytestmark = pytest.mark.slow  # verl's engines, in their own environment (scripts/dev test-verl), as test_verl.py

AGREE = 1e-5
TEMPERATURE = 0.7
SPEC = Spec(prompts=[14, 20, 9], responses=[[5, 8, 3, 6], [7, 2, 8, 4], [6, 6, 1, 8]])
ROWS = 12


def save_lfm2(path: str, family: str = "lfm2") -> str:
    """A tiny random LFM2 (conv, attention, conv; kernel 3) saved with save_pretrained; ``family="lfm2_moe"``: LFM2-MoE,
    its first layer's MLP dense and the other two mixtures of 4 experts (top 2, with its expert bias)."""
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
    if family == "lfm2_moe":
        cfg = tf.Lfm2MoeConfig(
            **common,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            architectures=["Lfm2MoeForCausalLM"],
        )
    else:
        cfg = tf.Lfm2Config(**common, block_auto_adjust_ff_dim=False, architectures=["Lfm2ForCausalLM"])
    torch.manual_seed(0)
    model = getattr(tf, cfg.architectures[0])(cfg)
    with torch.no_grad():  # a less uniform distribution than the tiny init gives, so that clipping and KL bite
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def path(request, tmp_path_factory):
    return save_lfm2(str(tmp_path_factory.mktemp(f"verl_{request.param}")), request.param)


@pytest.fixture(scope="module")
def engines(process_group, path):
    return build(FSDPEngineWithLMHead, path, remove_padding=False), build(SharedPrefixFSDPEngine, path)


def _make(remove_padding=True):
    return rl_batch(SPEC, temperature=TEMPERATURE, micro=4, remove_padding=remove_padding)


def _resp(td):
    return td["attention_mask"][:, -td["responses"].shape[1] :].bool()


def _errors(theirs, ours, path):
    td = _make()
    ref_lp, ref_ent, _ = reference(path, td, temperature=TEMPERATURE)
    out = {}
    for key, ref in (("log_probs", ref_lp), ("entropy", ref_ent)):
        a = responses_of(theirs["model_output"][key], td)
        b = responses_of(ours["model_output"][key], td)
        out[key] = (masked_rel(b, a, _resp(td)), masked_rel(b, ref, _resp(td)), masked_rel(a, ref, _resp(td)))
    print({k: [f"{x:.2g}" for x in v] for k, v in out.items()})  # ours vs verl, ours vs float64, verl vs float64
    return out


def test_verl_remove_padding_mixes_lfm2_rows(process_group, engines, path):
    """verl's engine with use_remove_padding=True: its convolution reads across the packed rows (each row's first
    tokens after the previous row's last ones), which puts it far beyond float32 rounding of the float64 rows, where
    verl's padded engine (the reference here) stays."""
    packed = build(FSDPEngineWithLMHead, path, remove_padding=True)
    td = _make()
    ref_lp, _, _ = reference(path, td, temperature=TEMPERATURE)
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


@pytest.mark.parametrize("budget", [None, 24], ids=["one_pass", "split"])
def test_gradients_match_verl(process_group, engines, path, monkeypatch, budget):
    """verl's clip + KL + entropy loss; under SHAREDPREFIX_MAX_TOKENS=24 each group's prompt runs once and its
    completions in several passes, reading the cached conv tails and K/V."""
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
    _, _, g_ref = reference(path, _make(), lf, temperature=TEMPERATURE)
    print(f"grads: ours vs verl {rel(g_s, g_v):.2g}, ours vs float64 {rel(g_s, g_ref):.2g}, verl {rel(g_v, g_ref):.2g}")
    assert min(float(g.abs().max()) for g in g_ref.values()) > 0
    assert rel(g_s, g_v) <= AGREE
    assert rel(g_s, g_ref) <= 2.0 * rel(g_v, g_ref)
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
