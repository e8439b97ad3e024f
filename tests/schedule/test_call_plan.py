"""``sp.plan_call``: a plan made once gives bit-identical log-probs and gradients to planning afresh, on the model it
was made for and on a model of the same configuration; a different model or disagreeing settings are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

import sharedprefix as sp
from tests.helpers import random_groups, tiny_model
from tests.support import vl

GROUPS = random_groups(0, 3, [20, 7, 15], [[5, 3, 8], [4], [6, 2]])
TREE = sp.Tree.from_rows([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 5, 6, 7]])


def _weights(out: sp.LogProbs) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(out.logprobs.shape, generator=g, dtype=out.logprobs.dtype)


def _logprobs_and_grads(model, source, **kw):
    """(log-probs, entropies, {name: grad}) of a grad-enabled sp.logprobs with a random linear loss."""
    model.zero_grad(set_to_none=True)
    out = sp.logprobs(model, source, entropy=True, **kw)
    (out.logprobs * _weights(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), out.entropy.detach(), grads


def _backward_grads(model, source, **kw):
    model.zero_grad(set_to_none=True)
    res = sp.backward(model, source, lambda b: (b.logprobs * (b.index[:, None] + 1.0)).sum(), **kw)
    return res.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


CASES = {
    "whole": (GROUPS, {}),
    "split": (GROUPS, dict(max_tokens=24)),
    "deferred": (GROUPS, dict(max_tokens=24, defer=True)),
    "tree": (TREE, dict(max_tokens=8)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reused_plan_is_bit_identical_to_planning_afresh(name):
    source, kw = CASES[name]
    model = tiny_model()
    want = _logprobs_and_grads(model, source, **kw)
    cp = sp.plan_call(model, source, **kw)
    for _ in range(2):  # the plan serves any number of calls
        got = _logprobs_and_grads(model, cp)
        for a, b in zip(got, want):
            _assert_equal(a, b)
    with torch.no_grad():
        assert torch.equal(sp.logprobs(model, cp).logprobs, sp.logprobs(model, source, **kw).logprobs)


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_reused_plan_backward_is_bit_identical_in_each_prefix_mode(mode):
    model = tiny_model()
    want = _backward_grads(model, GROUPS, max_tokens=24, prefix_activations=mode)
    cp = sp.plan_call(model, GROUPS, max_tokens=24, prefix_activations=mode)
    assert cp.splits and len(cp.passes) > 1
    for _ in range(2):
        got = _backward_grads(model, cp)
        _assert_equal(got[0], want[0])
        _assert_equal(got[1], want[1])
    # a setting the plan does not shape may change from call to call
    got = _backward_grads(model, cp, prefix_activations="keep")
    _assert_equal(got[1], want[1])


def test_plan_runs_on_a_reference_model_of_the_same_configuration():
    policy, reference = tiny_model(seed=0), tiny_model(seed=1)
    cp = sp.plan_call(policy, GROUPS, max_tokens=24)
    with torch.no_grad():
        got = sp.logprobs(reference, cp)
        want = sp.logprobs(reference, GROUPS, max_tokens=24)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.mask, want.mask)
        assert not torch.equal(got.logprobs, sp.logprobs(policy, cp).logprobs)
    _assert_equal(_backward_grads(reference, cp), _backward_grads(reference, GROUPS, max_tokens=24))


def test_plan_runs_on_a_peft_model_with_its_adapter_disabled():
    """TRL's reference log-probs of a PEFT policy run under ``disable_adapter()``: the plan made with the adapter on
    gives there exactly what planning afresh there gives, log-probs and gradients, and not the adapter's values."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model(), lora)  # init_lora_weights=False: the adapter changes the values
    model.requires_grad_(True)  # the base weights too, so that the adapter-off backward has gradients to compare
    cp = sp.plan_call(model, GROUPS, max_tokens=24)
    assert cp.splits
    on = _logprobs_and_grads(model, cp)
    with model.disable_adapter():
        off = _logprobs_and_grads(model, cp)
        _assert_equal(off, _logprobs_and_grads(model, GROUPS, max_tokens=24))
        _assert_equal(_backward_grads(model, cp), _backward_grads(model, GROUPS, max_tokens=24))
    assert not torch.equal(on[0], off[0])
    assert any("lora_" in n for n in on[2]) and not any("lora_" in n for n in off[2])  # the adapter took no part
    _assert_equal(_logprobs_and_grads(model, cp), on)  # enabled again: the adapter's values


def test_plan_is_refused_on_a_model_of_another_configuration():
    cp = sp.plan_call(tiny_model(), GROUPS, max_tokens=24)
    with pytest.raises(
        ValueError,
        match=r"CallPlan was made for another model .* its configuration \(config.to_dict\(\)\) differs at "
        r"config.intermediate_size: 40 here, 48 where the plan was made",
    ):
        sp.logprobs(tiny_model(intermediate_size=40), cp)
    with pytest.raises(ValueError, match=r"its config class differs: LlamaConfig here, Qwen3Config"):
        sp.logprobs(tiny_model("llama"), cp)
    with pytest.raises(ValueError, match=r"its parameters' dtype differs: torch.float32 here, torch.float64"):
        sp.logprobs(tiny_model(dtype=torch.float32), cp)


def test_plan_ignores_names_versions_dtype_and_use_cache_at_every_depth_of_the_config(tmp_path):
    """A Qwen2-VL reference saved and loaded in bfloat16, then cast (its ``dtype`` set in the config, ``text_config``
    and ``vision_config``, with a checkpoint name and ``architectures``), and the policy with
    ``text_config.use_cache=False`` (TRL turns it off on the policy only): the policy's plan runs on the reference,
    bit-identical to planning afresh there. Before, the nested keys were compared: "configuration differs"."""
    policy = vl.mrope_model("qwen2_vl")
    policy.save_pretrained(tmp_path)
    reference = tf.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).double().eval()
    nested = reference.config.to_dict()
    assert nested["text_config"]["dtype"] == nested["vision_config"]["dtype"] == "bfloat16"  # control: they differ
    assert policy.config.to_dict()["text_config"]["dtype"] != "bfloat16"
    policy.config.text_config.use_cache = False
    groups = vl.MROPE_GROUPS()
    cp = sp.plan_call(policy, groups)
    with torch.no_grad():
        assert torch.equal(sp.logprobs(reference, cp).logprobs, sp.logprobs(reference, groups).logprobs)


def test_a_nested_config_difference_is_refused_naming_its_key_and_both_values():
    policy, other = vl.mrope_model("qwen2_vl"), vl.mrope_model("qwen2_vl")
    text = other.config.text_config  # a new dict: the two configs share the one they were built from
    text.rope_parameters = {**text.rope_parameters, "rope_theta": 20000.0}
    cp = sp.plan_call(policy, vl.MROPE_GROUPS())
    with pytest.raises(
        ValueError,
        match=r"its configuration \(config.to_dict\(\)\) differs at config\.text_config\.rope_parameters\.rope_theta: "
        r"20000\.0 here, 1000000\.0 where the plan was made",
    ):
        sp.logprobs(other, cp)


def test_disagreeing_settings_are_refused():
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=24)
    with pytest.raises(ValueError, match=r"max_tokens=32 disagrees with the CallPlan's max_tokens=24"):
        sp.logprobs(model, cp, max_tokens=32)
    with pytest.raises(ValueError, match=r"backend='reference' disagrees with the CallPlan's backend='auto'"):
        sp.backward(model, cp, lambda b: b.logprobs.sum(), backend="reference")
    with torch.no_grad():  # the plan's own value, given again, agrees
        assert torch.equal(sp.logprobs(model, cp, max_tokens=24).logprobs, sp.logprobs(model, cp).logprobs)


def test_plan_call_checks_its_settings_and_the_groups():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"sp.plan_call got \['budget'\]"):
        sp.plan_call(model, GROUPS, budget=8)
    with pytest.raises(ValueError, match="temperature=0; expected a finite number > 0"):
        sp.plan_call(model, GROUPS, temperature=0)
    with pytest.raises(ValueError, match=r"has 5 tokens but max_tokens=4; .* Set max_tokens >= 8"):
        sp.plan_call(model, GROUPS, max_tokens=4)


def test_plan_holds_what_the_kernels_need():
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS, max_tokens=24)
    assert cp.refusals[:3] == ("check_supported", "validate", "select")
    assert cp.kernel.name == "cpu" and cp.device == torch.device("cpu") and cp.findings.calls == 1
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen
        cp.plan = None  # type: ignore[misc]
    with torch.no_grad():
        sp.logprobs(model, cp)
    layouts = dict(cp.rows.built)
    assert len(cp.rows) == len(cp.passes)
    with torch.no_grad():
        sp.logprobs(model, cp)
    assert all(cp.rows.built[k] is v for k, v in layouts.items())  # packed once per plan


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(temperature=float("nan")), ValueError, r"temperature=nan; expected a finite number > 0"),
        (dict(max_tokens=2.5), TypeError, r"max_tokens=2.5; expected a positive int"),
        (dict(backend="fast"), ValueError, r"attention backend 'fast' is unknown; expected one of \['auto'"),
        (dict(entropy="yes"), TypeError, r"entropy='yes'; expected True or False"),
        (dict(defer=1), TypeError, r"defer=1; expected None"),
        (dict(grad_reduction="avg"), ValueError, r"grad_reduction='avg'; expected one of \('sum', 'mean'\)"),
    ],
)
def test_every_setting_is_checked_where_the_options_are_built(kw, error, match):
    with pytest.raises(error, match=match):
        sp.logprobs(tiny_model(), GROUPS, **kw)
