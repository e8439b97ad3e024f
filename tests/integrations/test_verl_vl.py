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
    # each micro-batch holds two groups: two prompts computed once each, against six full rows
    computed, plain = ours["metrics"]["sharedprefix/tokens_computed"], ours["metrics"]["sharedprefix/tokens_plain"]
    assert all(c < p for c, p in zip(computed, plain))


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
    batch, regrouped and returned in verl's order), under dynamic micro-batches."""
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


def test_vl_rows_regrouped_and_their_refusals(engines, path):
    """Vision-language rows keep a call per micro-batch, rows regrouped by prompt (no step: ``verl_step`` serves text
    models), with that path's refusals: static micro-batches that split a group, and a loss that reads each
    micro-batch's rows (``kl_cov``) where the regrouped micro-batches hold other rows than verl's own."""
    _, es = engines
    spec = VLSpec(prompts=[((1, 4, 4), 2, 3), (None, 5, 0), (None, 4, 1)], responses=[[3, 1], [2, 5], [4, 2]])
    kw = dict(temperature=TEMPERATURE, order=[0, 2, 4, 1, 3, 5])
    with pytest.raises(ValueError, match="split across micro-batches.*multiples of rollout.n"):
        infer(es, vl_batch(path, spec, micro=1, **kw))
    kl_cov = loss_fn("clip_kl_entropy", 6, policy_loss={"loss_mode": "kl_cov", "kl_cov_ratio": 0.1})
    with pytest.raises(ValueError, match="loss_mode='kl_cov'.*differ from the ones verl's engine forms"):
        train(es, vl_batch(path, spec, micro=2, **kw), kl_cov)


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
