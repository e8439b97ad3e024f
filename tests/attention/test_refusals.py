"""Every feature sharedprefix cannot compute exactly is refused with a clear error, never a fallback."""

import types

import pytest
import torch

import sharedprefix as sp
from helpers import float64_faithful, plain_logprobs, random_groups, tiny_model
from sharedprefix.tools.reference import Float64Inside

GROUPS = random_groups(0, 1, [5], [[2, 3]])


def _tiny(model_type, **overrides):
    """``tiny_model(model_type)`` in float32 with eager attention."""
    return tiny_model(model_type, dtype=torch.float32, attn="eager", **overrides)


def test_attention_dropout_in_training_refused():
    model = tiny_model("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        sp.logprobs(model, GROUPS)
    model.eval()  # eval mode: dropout is off, the call is exact and allowed
    sp.logprobs(model, GROUPS)


def test_hidden_dropout_in_training_refused():
    model = tiny_model("gpt2", resid_pdrop=0.1)
    model.train()
    with pytest.raises(ValueError, match=r"dropout p=0.1 at .*Disable dropout"):
        sp.logprobs(model, GROUPS)


@pytest.mark.parametrize(
    "model_type, kw, match",
    [
        (
            "mamba",
            dict(state_size=8, intermediate_size=48),
            "mix tokens outside attention.*'mamba' is not one.*Mamba \\(v1\\) selective scan starts every multi-token "
            "forward from a zero state",
        ),
    ],
    ids=["mamba"],
)
def test_token_mixing_layers_refused(model_type, kw, match):
    """Hybrids outside the packed path (LFM2, Falcon-H1, Qwen3-Next ...: tests/model/test_hybrid_packed.py,
    test_hybrid_ssm.py) and the cache path (tests/model/test_hybrid.py) keep their refusal."""
    with pytest.raises(ValueError, match=match):
        sp.logprobs(_tiny(model_type, **kw), GROUPS)


def test_convolution_module_refused_even_without_layer_types():
    """A 1-d convolution that runs along the tokens of a text row is refused, whatever the layer types say."""
    model = tiny_model("llama")
    layer = model.model.layers[0]
    layer.add_module("shortconv", torch.nn.Conv1d(32, 32, 3, padding=2, groups=32).double())
    mlp = layer.mlp.forward
    layer.mlp.forward = lambda x: mlp(x) + layer.shortconv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
    with pytest.raises(ValueError, match=r"convolution over tokens \(model\.layers\.0\.shortconv: Conv1d\)"):
        sp.logprobs(model, GROUPS)


def test_convolution_that_does_not_run_on_text_is_not_refused():
    """An encoder's convolution (audio frames, image patches) that a text row never reaches mixes no tokens."""
    model = tiny_model("llama")
    model.model.add_module("audio_tower", torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3)).double())
    sp.logprobs(model, GROUPS)


def test_attention_softcapping_refused_on_a_backend_without_it(monkeypatch):
    """torch's CUDA flash ops have no soft-capping: such a backend refuses before any pass, naming the fix."""
    from sharedprefix.attention import kernels

    model = _tiny("gemma2", attn_logit_softcapping=50.0, sliding_window=4096)
    monkeypatch.setattr(kernels.CPU, "SOFTCAP", False)  # stands for the 'cuda' backend on this CPU-only machine
    match = r"soft-capping \(softcap=50.0\).*backend 'cpu'.*backend='flash_attn'.*FlexAttention is no way out here"
    with pytest.raises(ValueError, match=match):
        sp.logprobs(model, GROUPS)
    assert not kernels.CUDA.SOFTCAP and kernels.FlashAttn.SOFTCAP


def test_attention_softcapping_on_a_backend_without_it_takes_flex_attention_where_it_runs(monkeypatch):
    """Where FlexAttention runs (CUDA), a backend without soft-capping is not refused before the passes: the attention
    computes the capped layers with FlexAttention (``kernels.flex``). Here the CPU stands for CUDA (FlexAttention has
    a CPU forward, no backward): the log-probs equal the plain rows' in float64. (The first H200 run found this path
    refused before any pass by the up-front check, which predated it.)"""
    from torch.nn.attention.flex_attention import flex_attention

    from sharedprefix.attention import kernels
    from sharedprefix.attention.kernels import flex

    model = _tiny("gemma2", attn_logit_softcapping=0.5, sliding_window=4)
    model = float64_faithful(model.double())
    with torch.no_grad():  # scores of order one, so that the cap bites (checked below)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.k_proj.weight.mul_(40)
    groups = random_groups(3, 2, [9, 6], [[4, 2], [3]])
    with torch.no_grad():
        cpu_kernel = sp.logprobs(model, groups, max_tokens=12).logprobs  # the CPU kernel's exact soft-capping
    monkeypatch.setattr(kernels.CPU, "SOFTCAP", False)
    monkeypatch.setattr(flex, "unavailable", lambda device: None)
    # eager FlexAttention (CPU inductor cannot lower a score_mod that reads the cap); on CUDA it runs compiled
    monkeypatch.setitem(flex._COMPILED, "flex", flex_attention)
    used = []
    row_attention = flex.flex_row_attention
    monkeypatch.setattr(flex, "flex_row_attention", lambda *a, **k: used.append(1) or row_attention(*a, **k))
    with torch.no_grad():
        got = sp.logprobs(model, groups, max_tokens=12).logprobs  # the 9-token prompt cached: its K/V read back
    assert used, "FlexAttention did not run"
    with Float64Inside():  # the eager attention's float32 softmax kept float64 in the reference
        want = plain_logprobs(model, groups)[0]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = plain_logprobs(model, groups)[0]
    assert (got - cpu_kernel).abs().max() <= 1e-12
    # at scores of this size the plain forward differs from both kernels alike by 7e-9 (rounding inside transformers'
    # Gemma 2 forward that Float64Inside does not reach; the CPU kernel is held to 1e-9 at ordinary scores)
    assert (got - want).abs().max() <= 3e-8
    assert (uncapped - want).abs().max() > 1e-3, "the cap does not bite: the test would not see it ignored"
    for layer in model.model.layers:  # compiled layers: run eager around FlexAttention, with the warning
        layer.self_attn.attn_logit_softcapping = 0.5
        layer.compile()
    with torch.no_grad(), pytest.warns(UserWarning, match="soft-capping on the 'cpu' backend runs FlexAttention"):
        again = sp.logprobs(model, groups, max_tokens=12).logprobs
    assert (again - got).abs().max() <= 1e-12


def test_moe_router_loss_needs_its_coefficient_in_backward_and_is_returned_by_logprobs():
    """sp.backward asks for aux_loss_coef when the config turns the loss on (and runs once given it); sp.logprobs
    returns the loss whole (tests/model/test_router_aux.py holds both to the plain run)."""
    model = _tiny(
        "qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        output_router_logits=True,
    )
    with pytest.raises(
        ValueError, match="output_router_logits=True, so its forward returns an MoE load-balancing loss"
    ):
        sp.backward(model, GROUPS, lambda b: b.logprobs.sum())
    assert sp.backward(model, GROUPS, lambda b: b.logprobs.sum(), aux_loss_coef=0.01).aux_loss > 0
    assert sp.logprobs(model, GROUPS).aux_loss.requires_grad


@pytest.mark.slow
def test_moe_without_router_loss_is_exact():
    from helpers import float64_faithful, plain_logprobs

    model = _tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16).double()
    model.config._attn_implementation_internal = "sdpa"
    model.config._experts_implementation_internal = "eager"  # grouped_mm has no float64 kernel
    float64_faithful(model)
    groups = random_groups(1, 2, [6, 3], [[3, 4], [2]])
    ref, _ = plain_logprobs(model, groups)
    assert (sp.logprobs(model, groups).logprobs - ref).abs().max() <= 1e-9


def test_attention_that_bypasses_the_interface_refused():
    model = tiny_model("llama")

    def own_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), None

    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(own_attention, layer.self_attn)
    with pytest.raises(ValueError, match=r"ran in 0 of 2 layers; the model's attention bypasses"):
        sp.logprobs(model, GROUPS)


def test_head_that_cannot_be_reproduced_refused():
    model = tiny_model("llama")
    orig = model.forward

    def forward(*a, **k):
        out = orig(*a, **k)
        out.logits = out.logits * 2 + 1
        return out

    model.forward = forward
    with pytest.raises(ValueError, match="turns hidden states into logits in a way sharedprefix does not reproduce"):
        sp.logprobs(model, GROUPS)


def test_unknown_and_unavailable_backends():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="'magic' is unknown"):
        sp.logprobs(model, GROUPS, backend="magic")
    with pytest.raises(ValueError, match="'cuda' needs CUDA tensors, got cpu"):
        sp.logprobs(model, GROUPS, backend="cuda")
    with pytest.raises(ValueError, match="'flash_attn' needs CUDA tensors"):
        sp.logprobs(model, GROUPS, backend="flash_attn")


def test_bad_temperature_and_model_type():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="temperature=0"):
        sp.logprobs(model, GROUPS, temperature=0)
    with pytest.raises(TypeError, match="expected a transformers causal LM"):
        sp.logprobs(torch.nn.Linear(2, 2), GROUPS)
    with pytest.raises(TypeError, match="expected a transformers causal LM"):  # inside torch.compile's wrapper too
        sp.logprobs(torch.compile(torch.nn.Linear(2, 2)), GROUPS)


def test_attention_temperature_tuning_refused_without_llama4_modules_to_rescale():
    """Llama 4's own modules are rescaled to positions (tests/model/test_chunked_attention.py); any other model
    claiming the setting is refused."""
    model = tiny_model("llama")
    model.config.attn_temperature_tuning = True
    with pytest.raises(ValueError, match="attn_temperature_tuning.*finds no Llama 4 attention module"):
        sp.logprobs(model, GROUPS)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_scaling_refused(rope_type):
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=f"'{rope_type}' RoPE scaling"):
        sp.logprobs(model, GROUPS)


def test_random_forward_in_training_mode_refused():
    """Phi-MoE samples its expert routing in training mode: one draw for a shared prompt is not the plain run's."""
    from sharedprefix.tools import zoo

    model, _ = zoo.build("phimoe")
    groups = zoo.groups(model)
    sp.logprobs(model, groups)  # verified in eval mode first: training mode is checked again
    model.train()
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"forward in training mode draws random numbers"):
        sp.logprobs(model, groups)
    assert torch.equal(torch.random.get_rng_state(), state)  # the check leaves the caller's random stream alone
    model.eval()
    sp.logprobs(model, groups)


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_layer_without_a_mask_is_causal_unless_it_says_otherwise(is_causal, monkeypatch):
    """A model that builds no mask runs its layers causally in plain SDPA, unless a layer's is_causal is False
    (bidirectional): the probe tells the two apart."""
    from transformers.masking_utils import AttentionMaskInterface

    from sharedprefix.attention import probe

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, probe.NAME, lambda *a, **k: None)
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.is_causal = is_causal
    if is_causal:
        sp.logprobs(model, GROUPS)
    else:
        with pytest.raises(ValueError, match="neither causal nor a causal sliding window"):
            sp.logprobs(model, GROUPS)
