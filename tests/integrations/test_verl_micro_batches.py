"""sharedprefix's verl engine on verl's own micro-batches (one ``sp.plan_step`` step per mini-batch) against verl
0.9.1's own FSDP2 engine, on the same tiny model and batches (CPU; the separate verl environment, as ``test_verl.py``).

The engine computes verl's micro-batches as verl forms them: static ``micro_batch_size_per_gpu`` below rollout.n (the
rows of a group split across micro-batches), micro-batches of scattered rows, and verl's dynamic token-budget
micro-batches; each prompt is computed once per mini-batch. So every loss of verl's, the ones whose value depends on
which rows share a micro-batch too (``geo_mean``, ``kl_cov``, ``clip_cov``, bypass mode's batch-normalised importance
weights), reads the rows verl reads, and every metric verl's loss reports
per micro-batch (``actor/ppo_kl``, ``actor/pg_clipfrac``, ...) is verl's. A float64 plain forward of each row with
verl's loss summed over verl's micro-batches is the yardstick of the gradients where both float32 engines stay within
its rule (``test_verl.py``'s batch); elsewhere ours and verl's agree to 1e-5 relative.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if os.environ.get("SHAREDPREFIX_REQUIRE_VERL"):  # scripts/dev test-verl: in the verl environment a missing verl fails
    import verl  # noqa: F401
else:
    pytest.importorskip("verl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import verl_cpu  # noqa: E402,F401  (verl's CPU platform, before verl's engine modules load)
from verl_support import (  # noqa: E402
    FSDPEngineWithLMHead,
    Spec,
    build,
    float64_step,
    loss_fn,
    micro_batch_rows,
    rel,
    rl_batch,
    save_model,
    train,
)

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.verl import ENV_MAX_TOKENS, SharedPrefixFSDPEngine  # noqa: E402
from sharedprefix.integrations.verl_layout import response_lengths, rows_of  # noqa: E402

pytestmark = pytest.mark.slow
ROWS = 12
TEMPERATURE = 0.7
AGREE = 1e-5  # ours vs verl, relative to the largest value (float32 rounding is about 1e-6 here)
SCATTERED = [5, 0, 11, 2, 7, 1, 9, 4, 3, 10, 6, 8]
# 3 prompts (a 4-token system prompt shared by all) x 4 completions; the groups' longest responses differ (8, 7, 6)
SPEC = Spec(prompts=[14, 20, 9], responses=[[5, 8, 3, 6], [7, 2, 3, 4], [6, 2, 1, 5]])
NATURAL = Spec(prompts=SPEC.prompts, responses=SPEC.responses, order=SCATTERED)
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("verl_model")))


@pytest.fixture(scope="module")
def engines(process_group, path):
    return build(FSDPEngineWithLMHead, path), build(SharedPrefixFSDPEngine, path)


def _ppo(loss_agg_mode="token-mean", loss_mode="vanilla", **policy):
    """verl's ppo_loss with clipping, the k3 KL loss against the reference and the entropy bonus on
    (``LOSSES["clip_kl_entropy"]``) under ``loss_agg_mode`` and the policy loss ``loss_mode`` (``policy``: its
    other PolicyLossConfig settings)."""
    policy_loss = {"loss_mode": loss_mode, **policy}
    return loss_fn("clip_kl_entropy", ROWS, loss_agg_mode=loss_agg_mode, policy_loss=policy_loss)


def _bypass_reinforce_normalised():
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    corr = RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True)
    return _ppo(loss_mode="bypass_mode", rollout_correction=corr)


# verl 0.9.1's policy losses: an additive one, and the four whose value depends on the rows of each micro-batch
POLICY_LOSSES = {
    "vanilla": _ppo,
    "geo_mean": lambda: _ppo(loss_mode="geo_mean"),
    "kl_cov": lambda: _ppo(loss_mode="kl_cov", kl_cov_ratio=0.1),
    "clip_cov": lambda: _ppo(loss_mode="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-5.0),
    "bypass_reinforce_normalised": _bypass_reinforce_normalised,
}
# (spec, dynamic, micro-batch rows): groups of 4 in static micro-batches of 2 and 3 rows (groups split across them;
# of 3: in order and scattered), and verl's dynamic micro-batches (a 128-token budget) of scattered rows
SETTINGS = {
    "static2": (SPEC, False, 2),
    "static3": (SPEC, False, 3),
    "static3-scattered": (NATURAL, False, 3),
    "dynamic": (NATURAL, True, 4),
}


def _make(setting):
    spec, dynamic, micro = SETTINGS[setting]
    return lambda: rl_batch(spec, temperature=TEMPERATURE, dynamic=dynamic, micro=micro, max_tokens=128)


def _value(m):
    return m.aggregate() if hasattr(m, "aggregate") else m


def _tokens(td, parts):
    """(tokens of every row of the mini-batch as one tree, the ideal: every distinct prompt once plus every response
    token, and the tokens a call per micro-batch computes: each micro-batch's tree)."""
    resp = response_lengths(td["responses"], td.get("attention_mask", None))
    rows = rows_of(td["input_ids"], resp)
    once = sp.plan(rows.tree).tokens_computed
    prompts = {tuple(r[:p].tolist()) for r, p in zip(rows.tree.rows, rows.prompt_lengths.tolist())}
    ideal = sum(len(p) for p in prompts) + int(resp.sum())
    per_micro_batch = sum(sp.plan(rows.tree.subset(part)).tokens_computed for part in parts)
    return once, ideal, per_micro_batch


def _seeded(engine, make, lf, seed=0):
    torch.manual_seed(seed)  # clip_cov draws its clipped tokens at random: the same seed, the same draw
    return train(engine, make(), lf)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_gradients_and_metrics_match_verl(engines, loss, setting):
    """Each policy loss, each micro-batching: verl's gradients, summed losses and every per-micro-batch metric; each
    prompt computed once per mini-batch (tokens with grad: every distinct prompt once, every response token once)."""
    ev, es = engines
    make, lf = _make(setting), POLICY_LOSSES[loss]()
    td = make()
    parts = micro_batch_rows(td)
    group = [(SCATTERED[i] if SETTINGS[setting][0] is NATURAL else i) // 4 for i in range(ROWS)]
    where: dict = {}
    for m, mb in enumerate(parts):
        for i in mb:
            where.setdefault(group[i], set()).add(m)
    assert any(len(m) > 1 for m in where.values())  # groups split across micro-batches
    (out_v, g_v), (out_s, g_s) = _seeded(ev, make, lf), _seeded(es, make, lf)
    if loss == "clip_cov":  # the draw matters: another seed, another gradient
        assert rel(_seeded(ev, make, lf, 1)[1], g_v) > 1000 * AGREE
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
    m_v, m_s = out_v["metrics"], out_s["metrics"]
    assert _value(m_v["kl_loss"]) > 0  # the KL loss bites (and the clipping, where the policy loss clips)
    assert loss in ("kl_cov", "bypass_reinforce_normalised") or _value(m_v["actor/pg_clipfrac"]) > 0
    for key, value in m_v.items():  # verl's per-micro-batch means too (actor/ppo_kl, actor/pg_clipfrac, ...)
        assert _value(m_s[key]) == pytest.approx(_value(value), rel=AGREE, abs=1e-6), key
    once, ideal, per_micro_batch = _tokens(td, parts)
    computed = sum(m_s["sharedprefix/tokens_computed"])
    assert computed == once <= 1.02 * ideal
    assert per_micro_batch > 1.2 * computed  # what a call per micro-batch computes: each split prompt again
    # without a graph: the step's recording of the prompts shared across micro-batches (recomputed with grad)
    assert 0 < sum(m_s["sharedprefix/tokens_no_grad"]) < once


@pytest.mark.parametrize("setting, budget", [("static2", 8), ("dynamic", 24)])
@pytest.mark.parametrize("loss", ["vanilla", "geo_mean", "kl_cov"])
def test_budget_that_splits_micro_batches(process_group, path, monkeypatch, loss, setting, budget):
    """SHAREDPREFIX_MAX_TOKENS below a micro-batch's own tokens (static2: two responses of up to 8 tokens under 8,
    the prompts split into segments of 8; dynamic: micro-batches of 2 to 4 groups under 24): verl's loss of each
    micro-batch on values computed first (one no-grad call over the mini-batch), its gradient through the step's
    sp.backward as a linear loss."""
    monkeypatch.setenv(ENV_MAX_TOKENS, str(budget))
    es = build(SharedPrefixFSDPEngine, path)
    monkeypatch.delenv(ENV_MAX_TOKENS)
    ev = build(FSDPEngineWithLMHead, path)
    make, lf = _make(setting), POLICY_LOSSES[loss]()
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
    for key, value in out_v["metrics"].items():
        assert _value(out_s["metrics"][key]) == pytest.approx(_value(value), rel=AGREE, abs=1e-6), key
    td = make()
    once, _, _ = _tokens(td, micro_batch_rows(td))
    assert sum(out_s["metrics"]["sharedprefix/tokens_computed"]) == once  # with grad: every token once
    assert sum(out_s["metrics"]["sharedprefix/tokens_no_grad"]) >= once  # the values first, the recordings


@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_agg_modes_on_verls_dynamic_micro_batches(engines, mode):
    """Every loss_agg_mode (KL loss and entropy bonus on) on verl's dynamic micro-batches of scattered rows.
    seq-mean-token-sum-norm without loss_scale_factor divides by response_mask's width, which verl keeps padded to the
    batch's longest response in every micro-batch (left_right_2_no_padding): 8, although its micro-batches hold rows
    of other longest responses."""
    ev, es = engines
    make, lf = _make("dynamic"), _ppo(mode)
    td = make()
    assert td["response_mask"].shape[1] == 8 and not td["response_mask"].is_nested
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
    for key, value in out_v["metrics"].items():
        assert _value(out_s["metrics"][key]) == pytest.approx(_value(value), rel=AGREE, abs=1e-6), key


@pytest.mark.parametrize("budget", [None, 8], ids=["one-pass", "budget"])
@pytest.mark.parametrize("failing", [0, 1, 5])
def test_failed_micro_batch_ends_the_step_as_verl(process_group, path, monkeypatch, failing, budget):
    """verl's loss raises in micro-batch ``failing`` (of 6: groups of 4 in micro-batches of 2): the error propagates
    and the step ends (the shared prompts' share of the micro-batches that finished delivered, the cache released).
    FSDP2 keeps the gradients accumulated outside its reduction, which the next mini-batch's reduction adds: those of
    the finished micro-batches, in verl's engine as in ours, so that the next mini-batch's gradients (a step of its
    own) agree with verl's. Under the budget the loss is evaluated outside sharedprefix's calls (values first)."""
    if budget is not None:
        monkeypatch.setenv(ENV_MAX_TOKENS, str(budget))
    es = build(SharedPrefixFSDPEngine, path)
    monkeypatch.delenv(ENV_MAX_TOKENS, raising=False)
    ev = build(FSDPEngineWithLMHead, path)
    make, lf = _make("static2"), _ppo()

    def failing_loss():
        calls = []

        def fn(**kw):
            calls.append(1)
            if len(calls) == failing + 1:
                raise RuntimeError("loss failed on purpose")
            return lf(**kw)

        return fn

    grads = []
    for engine in (ev, es):
        with pytest.raises(RuntimeError, match="loss failed on purpose"):
            train(engine, make(), failing_loss())
        grads.append(train(engine, make(), lf)[1])
    fresh = train(ev, make(), lf)[1]
    assert rel(grads[1], grads[0]) <= AGREE
    assert (rel(grads[0], fresh) > 0.1) == (failing > 0)  # the finished micro-batches' gradients were kept


def _float64_grads(path, td, loss, parts):
    """verl's loss of a float64 plain forward of each row, summed over the micro-batches ``parts`` (row lists), as
    verl's engine evaluates it micro-batch by micro-batch: the gradient, by parameter."""
    return float64_step(path, td, loss, parts, TEMPERATURE)[2]


@pytest.mark.parametrize("loss", AGG_MODES + ["geo_mean", "kl_cov"])
def test_verl_loss_over_micro_batches_float64(process_group, path, loss):
    """Why the micro-batches must be verl's own, in float64 without the engines: verl's loss summed over verl's own
    micro-batches of scattered rows (static and dynamic) equals its sum over whole-group micro-batches and over one
    micro-batch of every row, to 1e-12, for every loss_agg_mode (KL loss and entropy bonus on); the
    micro-batch-dependent policy losses differ by orders of magnitude more."""
    lf = _ppo(loss) if loss in AGG_MODES else POLICY_LOSSES[loss]()
    group = [SCATTERED[i] // 4 for i in range(ROWS)]
    make = lambda dynamic: rl_batch(NATURAL, temperature=TEMPERATURE, dynamic=dynamic, micro=4, max_tokens=128)  # noqa: E731
    parts = {
        "static": micro_batch_rows(make(False)),
        "dynamic": micro_batch_rows(make(True)),
        "groups": [[i for i in range(ROWS) if group[i] == g] for g in range(3)],
        "one": [list(range(ROWS))],
    }
    grads = {name: _float64_grads(path, make(False), lf, p) for name, p in parts.items()}
    errors = {name: rel(g, grads["groups"]) for name, g in grads.items()}
    if loss in AGG_MODES:
        assert max(errors.values()) <= 1e-12, errors
    else:  # measured (dynamic, one micro-batch, static): geo_mean 0.66, 1.3, 0; kl_cov 0.23, 0.24, 0.16
        assert min(errors["dynamic"], errors["one"]) > 1e-3, errors
        # geo_mean's micro-batch means weigh each row by 1 / its micro-batch's size, equal in static micro-batches
        assert (errors["static"] == 0.0) == (loss == "geo_mean"), errors


def test_reshard_after_forward_false(process_group, path):
    """``reshard_after_forward=False`` (verl passes it to fully_shard for every module, the root too) with several
    micro-batches: verl's gradients. The core's ``sync=False`` calls leave a wrong gradient on the parameters of FSDP2
    modules not resharded after forward (0.36 relative here; fixed in the core by f8d2502 on another branch), so the
    engine reduces every micro-batch there instead of deferring to the last."""
    ev = build(FSDPEngineWithLMHead, path, reshard_after_forward=False)
    es = build(SharedPrefixFSDPEngine, path, reshard_after_forward=False)
    make, lf = _make("static2"), _ppo()
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
