"""Vision-language rows (verl's ``multi_modal_inputs``) through sharedprefix's verl engine, against verl's own engine
on tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models (CPU, float32).

verl's own engine cannot run a Qwen2-VL with ``use_remove_padding=True`` on CPU: verl then replaces
``Qwen2VLAttention.forward`` with ``verl.models.transformers.qwen2_vl.qwen2_vl_attn_forward``, which reads
``_flash_use_top_left_mask`` and calls ``flash_attn_varlen_func``, names that module defines only when flash-attn
(or an NPU) is available, so it raises ``NameError`` here (``test_verl_cannot_run_remove_padding_on_cpu`` keeps that
true). The reference is therefore verl's engine as it runs with ``use_remove_padding=False``: verl's own patched
model forwards (``qwen2_vl_base_forward``, ``forward_with_normal_backend``), its multi_modal_inputs concatenation and
its 3-D position ids, on padded rows with transformers' SDPA attention. Ours is built with ``use_remove_padding=True``
(the setting verl users run), so verl has patched the attention process-wide, and the engine undoes every verl
patch for the duration of its passes (``verl_vl.own_forward``).

Qwen2.5-VL shares Qwen2-VL's attention replacement (the same reference). Qwen3-VL's attention verl leaves alone (it
replaces its model forwards), and verl's engine runs it with ``use_remove_padding=True`` here: that is its reference
(it agrees with verl's padded path to 1.0e-7 on log-probs). Measured (temperature 0.7, ours vs verl, relative to the
largest value): log-probs 2.0e-7 / 1.5e-7 / 1.0e-7, entropy 1.5e-6 / 1.5e-6 / 1.3e-6, gradients 9.6e-7 / 6.3e-7 /
9.9e-7 for Qwen2-VL / Qwen2.5-VL / Qwen3-VL. Batches mix image groups and a text group in one micro-batch (verl's padded
path fails on a micro-batch without images under transformers 5: its dummy vision call takes ``.mean()`` of the
vision tower's output object).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

if os.environ.get("SHAREDPREFIX_REQUIRE_VERL"):
    import verl  # noqa: F401
else:
    pytest.importorskip("verl")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_cpu  # noqa: E402, F401  (verl's CPU platform, before verl's engine modules load)
from verl_support import (  # noqa: E402
    IMAGE,
    FSDPEngineWithLMHead,
    VLSpec,
    build,
    configs,
    infer,
    loss_fn,
    masked_rel,
    rel,
    responses_of,
    save_vl_model,
    train,
    verl_attention_unpatched,
    vl_batch,
)

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations import verl_vl  # noqa: E402
from sharedprefix.integrations.verl import SharedPrefixFSDPEngine  # noqa: E402
from sharedprefix.integrations.verl_layout import response_lengths, rows_of  # noqa: E402

pytestmark = pytest.mark.slow  # verl's engines, in their own environment (scripts/dev test-verl), as test_verl.py

AGREE = 1e-5
TEMPERATURE = 0.7
# 4 groups of 3 rows: image prompts of 4, 2 and 2 image tokens and a text prompt; micro-batches of 2 groups
SPEC = VLSpec(
    prompts=[((1, 4, 4), 2, 3), (None, 5, 0), ((1, 2, 4), 1, 0), ((1, 4, 2), 0, 2)],
    responses=[[3, 1, 4], [2, 5, 6], [2, 3, 1], [4, 1, 2]],
)
ROWS = 12


KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def path(process_group):
    return save_vl_model(tempfile.mkdtemp())


@pytest.fixture(scope="module")
def engines(path):
    return build(FSDPEngineWithLMHead, path, remove_padding=False), build(SharedPrefixFSDPEngine, path)


@pytest.fixture(scope="module", params=KINDS)
def any_vl(request, process_group):
    """(path, verl's engine, ours, verl's use_remove_padding) for each model type; Qwen2-VL's are the module's own.
    Qwen3-VL: verl's engine with use_remove_padding=True (verl leaves its attention alone, and it runs here)."""
    if request.param == "qwen2_vl":
        p = request.getfixturevalue("path")
        return (p, *request.getfixturevalue("engines"), False)
    p = save_vl_model(tempfile.mkdtemp(), request.param)
    remove_padding = request.param == "qwen3_vl"
    return (
        p,
        build(FSDPEngineWithLMHead, p, remove_padding=remove_padding),
        build(SharedPrefixFSDPEngine, p),
        remove_padding,
    )


def _batches(path, verl_remove_padding=False, **kw):
    ours = lambda: vl_batch(path, SPEC, temperature=TEMPERATURE, micro=6, **kw)  # noqa: E731
    theirs = lambda: vl_batch(path, SPEC, temperature=TEMPERATURE, micro=6, remove_padding=verl_remove_padding, **kw)  # noqa: E731
    return ours, theirs


def _resp(td):
    return td["attention_mask"][:, -td["responses"].shape[1] :].bool()


def test_verl_patched_the_attention(engines):
    """The premise: our engine's build let verl replace the attention forward (use_remove_padding=True)."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    assert m.Qwen2VLAttention.forward.__module__.startswith("verl.")
    assert m.Qwen2VLModel.forward.__module__.startswith("verl.")


def test_vl_logprobs_match_verl(any_vl):
    path, ev, es, verl_remove_padding = any_vl
    ours_td, theirs_td = _batches(path, verl_remove_padding)
    with verl_attention_unpatched():
        theirs = infer(ev, theirs_td())
    ours = infer(es, ours_td())
    td = ours_td()
    for key in ("log_probs", "entropy"):
        err = masked_rel(
            responses_of(ours["model_output"][key], td), responses_of(theirs["model_output"][key], td), _resp(td)
        )
        assert err <= AGREE, (key, err)
    # one call over the mini-batch (each prompt once), reported in the first micro-batch, against twelve full rows
    computed, plain = ours["metrics"]["sharedprefix/tokens_computed"], ours["metrics"]["sharedprefix/tokens_plain"]
    assert computed[0] == sum(computed) < sum(plain)


def test_vl_gradients_match_verl(any_vl):
    path, ev, es, verl_remove_padding = any_vl
    ours_td, theirs_td = _batches(path, verl_remove_padding)
    lf = loss_fn("clip_kl_entropy", ROWS)
    with verl_attention_unpatched():
        out_v, g_v = train(ev, theirs_td(), lf)
    out_s, g_s = train(es, ours_td(), lf)
    visual = [n for n in g_v if "visual" in n]
    assert visual and max(float(g_v[n].abs().max()) for n in visual) > 0  # the vision tower is trained
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)


def test_vl_same_prompt_tokens_other_images_scattered_dynamic(engines, path):
    """Two groups with the same prompt tokens but different images are two groups (their rows interleaved in the
    batch, and in verl's micro-batches), under dynamic micro-batches."""
    ev, es = engines
    spec = VLSpec(
        prompts=[((1, 4, 4), 2, 3), ((1, 4, 4), 2, 3), (None, 5, 0)], responses=[[3, 1], [2, 5], [4, 2]], same_text=(1,)
    )
    order = [0, 2, 4, 1, 3, 5]
    kw = dict(temperature=TEMPERATURE, dynamic=True, max_tokens=4096, order=order)
    ours_td = lambda: vl_batch(path, spec, **kw)  # noqa: E731
    td = ours_td()
    rows = td["input_ids"].unbind()
    p = int(td["input_ids"].offsets().diff()[0]) - 3  # row 0: group 0's prompt, then its 3-token response
    assert torch.equal(rows[0][:p], rows[1][:p])  # row 1 (group 1): the same prompt tokens
    with verl_attention_unpatched():
        theirs = infer(ev, vl_batch(path, spec, remove_padding=False, **kw))
    ours = infer(es, ours_td())
    for key in ("log_probs", "entropy"):
        err = masked_rel(
            responses_of(ours["model_output"][key], td), responses_of(theirs["model_output"][key], td), _resp(td)
        )
        assert err <= AGREE, (key, err)


def _ppo(rows, loss_mode="vanilla", **policy):
    """verl's ppo_loss (clipping, the k3 KL loss, the entropy bonus) with the policy loss ``loss_mode``."""
    return loss_fn("clip_kl_entropy", rows, policy_loss={"loss_mode": loss_mode, **policy})


def _bypass_reinforce_normalised(rows):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    corr = RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True)
    return _ppo(rows, loss_mode="bypass_mode", rollout_correction=corr)


# an additive policy loss and verl 0.9.1's four whose value depends on the rows of each micro-batch
POLICY_LOSSES = {
    "vanilla": _ppo,
    "geo_mean": lambda rows: _ppo(rows, "geo_mean"),
    "kl_cov": lambda rows: _ppo(rows, "kl_cov", kl_cov_ratio=0.1),
    "clip_cov": lambda rows: _ppo(rows, "clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-5.0),
    "bypass_reinforce_normalised": _bypass_reinforce_normalised,
}
# 3 image groups of 4 rows (every row holds an image: verl's padded reference path needs one in each micro-batch),
# scattered as verl's balancing may leave them; verl's micro-batches: static of 2 and 3 rows (below rollout.n = 4)
# and dynamic under a 40-token budget (rows of 6 to 16 tokens)
SCATTER = VLSpec(
    prompts=[((1, 4, 4), 2, 3), ((1, 2, 4), 1, 0), ((1, 4, 2), 0, 2)],
    responses=[[3, 1, 4, 2], [2, 5, 1, 3], [4, 2, 3, 1]],
)
ORDER = [5, 0, 10, 2, 7, 1, 9, 4, 11, 3, 6, 8]
MICRO = {"static2": (False, 2), "static3": (False, 3), "dynamic": (True, None)}


def _micro_batches(td):
    """verl's own micro-batches of ``td`` (row lists), as its engine forms them."""
    from verl.workers.engine.utils import prepare_micro_batches

    mbs, indices = prepare_micro_batches(data=td, dp_group=None, same_micro_num_in_dp=True)
    if indices is not None:
        return [list(map(int, i)) for i in indices]
    sizes = [len(mb) for mb in mbs]
    return [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(len(sizes))]


def _value(m):
    return m.aggregate() if hasattr(m, "aggregate") else m


@pytest.mark.parametrize("setting", list(MICRO))
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_vl_on_verls_micro_batches_match_verl(engines, path, loss, setting):
    """Vision-language rows on verl's own micro-batches (one step per mini-batch, each image prompt once): static
    micro-batches below rollout.n and dynamic ones, groups split across them, each policy loss (those whose value
    depends on the rows of a micro-batch too): verl's gradients, summed losses, every per-micro-batch metric, and
    the forward-only log-probs and entropies."""
    ev, es = engines
    dynamic, micro = MICRO[setting]
    kw = dict(temperature=TEMPERATURE, order=ORDER, dynamic=dynamic, micro=micro, max_tokens=40)
    ours_td = lambda: vl_batch(path, SCATTER, **kw)  # noqa: E731
    theirs_td = lambda: vl_batch(path, SCATTER, remove_padding=False, **kw)  # noqa: E731
    td = ours_td()
    parts = _micro_batches(td)
    group = [ORDER[i] // 4 for i in range(len(ORDER))]
    spread = {g: {m for m, mb in enumerate(parts) for i in mb if group[i] == g} for g in range(3)}
    assert len(parts) > 2 and all(len(m) > 1 for m in spread.values())  # every group split across micro-batches
    lf = POLICY_LOSSES[loss](len(ORDER))
    with verl_attention_unpatched():
        torch.manual_seed(0)  # clip_cov draws its clipped tokens at random: the same seed, the same draw
        out_v, g_v = train(ev, theirs_td(), lf)
        inf_v = infer(ev, theirs_td())
    torch.manual_seed(0)
    out_s, g_s = train(es, ours_td(), lf)
    inf_s = infer(es, ours_td())
    assert any("visual" in n for n in g_v) and rel(g_s, g_v) <= AGREE
    # (abs: bypass reinforce's micro-batch losses, -1.5 to 0.92 here, sum to 1.35e-3; each agrees with verl's to
    # float32 rounding, about 1e-7, and their sum measured 2.4e-7 apart)
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE, abs=1e-6)
    m_v, m_s = out_v["metrics"], out_s["metrics"]
    assert _value(m_v["kl_loss"]) > 0
    for key, value in m_v.items():  # verl's per-micro-batch means too (actor/ppo_kl, actor/pg_clipfrac, ...)
        assert _value(m_s[key]) == pytest.approx(_value(value), rel=AGREE, abs=1e-6), key
    for key in ("log_probs", "entropy"):
        err = masked_rel(
            responses_of(inf_s["model_output"][key], td), responses_of(inf_v["model_output"][key], td), _resp(td)
        )
        assert err <= AGREE, (key, err)
    # each image prompt once per mini-batch (with grad: every prompt once, every response token once)
    rows = rows_of(td["input_ids"], response_lengths(td["responses"], td.get("attention_mask", None)))
    inputs = verl_vl.row_inputs(td, len(ORDER))
    groups, _ = verl_vl.vl_groups(list(rows.tree.rows), rows.prompt_lengths, inputs, es.module.config)
    assert len(groups) == 3
    computed = sum(m_s["sharedprefix/tokens_computed"])
    assert computed == sp.plan(groups).tokens_computed < sum(m_s["sharedprefix/tokens_plain"])


def test_vl_budget_that_splits_groups(path, monkeypatch):
    """SHAREDPREFIX_MAX_TOKENS below a micro-batch's tokens: several passes (an image prompt stays in one)."""
    monkeypatch.setenv("SHAREDPREFIX_MAX_TOKENS", "20")
    es = build(SharedPrefixFSDPEngine, path)
    monkeypatch.delenv("SHAREDPREFIX_MAX_TOKENS")
    ev = build(FSDPEngineWithLMHead, path, remove_padding=False)
    ours_td, theirs_td = _batches(path)
    lf = loss_fn("clip_kl_entropy", ROWS)
    with verl_attention_unpatched():
        _, g_v = train(ev, theirs_td(), lf)
    out_s, g_s = train(es, ours_td(), lf)
    assert rel(g_s, g_v) <= AGREE


def test_verl_patches_restored_after_a_call_that_raises(engines, path):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    _, es = engines
    before = (m.Qwen2VLAttention.forward, m.Qwen2VLModel.forward, m.Qwen2VLForConditionalGeneration.forward)
    seen = []

    def failing(*args, **kwargs):
        seen.append(m.Qwen2VLAttention.forward)  # inside our call: transformers' own forward
        raise RuntimeError("inside the pass")

    es.module.model.language_model.layers[0].self_attn.register_forward_pre_hook(sp.allow_hook(failing))
    try:
        with pytest.raises(RuntimeError, match="inside the pass"):
            infer(es, _batches(path)[0]())
    finally:
        es.module.model.language_model.layers[0].self_attn._forward_pre_hooks.clear()
    assert seen and seen[0] is verl_vl.ORIGINALS[(m.Qwen2VLAttention, "forward")]
    assert (m.Qwen2VLAttention.forward, m.Qwen2VLModel.forward, m.Qwen2VLForConditionalGeneration.forward) == before


def test_verl_cannot_run_remove_padding_on_cpu(engines, path):
    """Why the reference runs verl's padded path: verl's flash-attention replacement needs flash-attn."""
    ev, _ = engines
    with pytest.raises(NameError, match="_flash_use_top_left_mask|flash_attn_varlen_func"):
        infer(ev, vl_batch(path, SPEC, micro=6))  # verl's engine on verl's packed rows, attention patched


def _shifted_vision_positions(td):
    pos = td["position_ids"]
    rows = [p.clone() for p in pos.unbind()]
    rows[0][2] += 1  # one M-RoPE axis of row 0 off by one
    td["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _image_in_response(td):
    ids = td["input_ids"]
    values = ids.values().clone()
    values[int(ids.offsets()[1]) - 1] = IMAGE  # the last token of row 0 (a response token)
    td["input_ids"] = torch.nested.nested_tensor_from_jagged(values, ids.offsets())


@pytest.mark.parametrize(
    "change, match",
    [
        (_shifted_vision_positions, "position_ids of row 0 are not the model's own"),
        (_image_in_response, "response holds image"),
    ],
    ids=["positions", "image in response"],
)
def test_vl_batches_refused(engines, path, change, match):
    _, es = engines
    td = _batches(path)[0]()
    change(td)
    with pytest.raises(ValueError, match=match):
        infer(es, td)


def test_vl_with_ulysses_refused_at_build(path):
    model, eng, optim, ckpt = configs(path, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 with the vision-language model 'qwen2_vl'"):
        SharedPrefixFSDPEngine(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)
