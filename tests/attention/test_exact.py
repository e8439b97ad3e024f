"""sp.logprobs against a plain transformers forward of each [prompt + completion] row."""

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedprefix as sp
from helpers import (
    TEST_SETTINGS,
    assert_grads_close,
    grads_of,
    on_kernel_paths,
    plain_logprobs,
    random_groups,
    tiny_model,
)

LAYOUTS = {
    "mixed": ([5, 1, 9], [[3, 4, 1], [2], [6, 6, 2, 1]]),
    "prompt_of_1": ([1], [[4, 2, 7]]),
    "completion_of_1": ([6], [[1], [1], [1]]),
    "group_of_1": ([7], [[5]]),
    "group_of_24": ([11], [[1 + (i * 7) % 5 for i in range(24)]]),
    "unbalanced": ([40, 1, 2], [[1, 30], [25], [1, 1, 2]]),
}


def _check(model, groups, temperature=1.0, entropy=False, rtol=1e-9, atol=1e-9, backend="sdpa"):
    ref, ref_ent = plain_logprobs(model, groups, temperature, entropy)
    out = sp.logprobs(model, groups, temperature=temperature, entropy=entropy, backend=backend)
    assert out.logprobs.shape == ref.shape and out.mask.shape == ref.shape
    lens = [c.numel() for g in groups for c in g.completions]
    assert out.mask.sum(1).tolist() == lens
    assert (out.logprobs[~out.mask] == 0).all()
    assert (out.logprobs - ref).abs().max() <= atol
    if entropy:
        assert (out.entropy - ref_ent).abs().max() <= atol
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, groups, temperature, entropy)[0] * w).sum())
    got = grads_of(
        model, lambda: (sp.logprobs(model, groups, temperature=temperature, backend=backend).logprobs * w).sum()
    )
    assert_grads_close(got, want, rtol)
    return out


# the heaviest cases are slow (10-50 s each on a loaded 2-core machine); qwen3 and llama stay in the inner loop
SLOW_ARCHS = [("cpu", a) for a in ("qwen2", "gemma", "gpt2", "mistral")]
SLOW_ARCHS += [("reference", a) for a in ("gemma", "phi3", "qwen2", "gpt2")]


@pytest.mark.parametrize(
    "kernel_path, arch", on_kernel_paths(sorted(TEST_SETTINGS), slow=SLOW_ARCHS), indirect=["kernel_path"]
)
def test_float64_logprobs_and_grads_match_plain(arch, kernel_path):
    model = tiny_model(arch)
    out = _check(model, random_groups(0, 3, *LAYOUTS["mixed"]))
    assert out.logprobs.dtype == torch.float64 and out.logprobs.requires_grad


@pytest.mark.parametrize(
    "kernel_path, layout",
    on_kernel_paths(sorted(LAYOUTS), slow=[("reference", "group_of_24")]),
    indirect=["kernel_path"],
)
def test_layouts(layout, kernel_path):
    p, c = LAYOUTS[layout]
    _check(tiny_model("qwen3"), random_groups(2, len(p), p, c))


def test_eager_backend_temperature_and_entropy():
    model = tiny_model("llama")
    groups = random_groups(3, 2, [4, 6], [[3, 1], [5, 2, 2]])
    out = _check(model, groups, temperature=0.7, entropy=True, backend="eager")
    assert out.entropy.shape == out.logprobs.shape and (out.entropy[out.mask] > 0).all()
    _check(model, groups, temperature=1.3, entropy=True)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 12), st.lists(st.integers(1, 8), min_size=1, max_size=6)), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(spec, seed):
    model = _MODEL
    groups = random_groups(seed, len(spec), [s[0] for s in spec], [s[1] for s in spec])
    ref, _ = plain_logprobs(model, groups)
    with torch.no_grad():
        out = sp.logprobs(model, groups)
    assert (out.logprobs - ref.detach()).abs().max() <= 1e-9


_MODEL = tiny_model("qwen2", seed=5)


def test_several_groups_one_row_single_attention_call_per_layer(monkeypatch):
    """All groups go into one packed row: each layer calls the attention function once."""
    from sharedprefix.attention import interface

    calls = []
    orig = interface.shared_prefix_attention

    def spy(module, query, *a, **k):
        calls.append(query.shape[2])
        return orig(module, query, *a, **k)

    monkeypatch.setitem(tf.AttentionInterface._global_mapping, interface.NAME, spy)
    model = tiny_model("llama")
    groups = random_groups(0, 3, [5, 1, 9], [[3, 4, 1], [2], [6, 6, 2, 1]])
    sp.logprobs(model, groups)
    assert calls == [5 + 8 + 1 + 2 + 9 + 15] * model.config.num_hidden_layers


def _spy_calls(monkeypatch):
    """Record (queries, keys, entries, causal, window, keys are a view of the row's) of every primitive call, with
    dense dispatch off (these are the varlen cascade's calls; tests/attention/test_dense.py counts the dense ones)."""
    from sharedprefix.attention import kernels
    from sharedprefix.attention.kernels import dense

    monkeypatch.setitem(dense._STATE, "enabled", False)
    seen = []
    orig = kernels.CPU.forward

    def spy(call):
        k = call.k
        seen.append(
            (call.q.shape[0], k.shape[0], call.cu_seqlens_q.numel() - 1, call.causal, call.window, k._base is not None)
        )
        return orig(call)

    monkeypatch.setattr(kernels.CPU, "forward", staticmethod(spy))
    return seen


def test_prompt_kv_read_once_by_all_completions(monkeypatch):
    """Two calls per layer: every segment causally on itself, then all 16 completions against one uncopied prompt."""
    seen = _spy_calls(monkeypatch)
    model = tiny_model("llama")
    with torch.no_grad():
        sp.logprobs(model, random_groups(0, 1, [50], [[4] * 16]))
    assert seen == [(114, 114, 17, True, None, True), (64, 50, 1, False, None, True)] * model.config.num_hidden_layers


def test_calls_per_layer_do_not_grow_with_groups(monkeypatch):
    """Several groups in one row: still one causal call and one dense call (one entry per prompt) per layer."""
    seen = _spy_calls(monkeypatch)
    model = tiny_model("llama")
    with torch.no_grad():
        sp.logprobs(model, random_groups(0, 3, [5, 1, 9], [[3, 4, 1], [2], [6, 6, 2, 1]]))
    per_layer = [(40, 40, 11, True, None, True), (25, 15, 3, False, None, True)]
    assert seen == per_layer * model.config.num_hidden_layers


def test_float32_within_twice_plain_error():
    model64 = tiny_model("qwen3", dtype=torch.float64)
    model32 = tiny_model("qwen3", dtype=torch.float32)
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    groups = random_groups(4, 3, [30, 7, 18], [[12, 3, 9, 9], [20], [5, 5, 5, 1, 16]])
    with torch.no_grad():
        exact, _ = plain_logprobs(model64, groups)
        plain32, _ = plain_logprobs(model32, groups)
        ours = sp.logprobs(model32, groups).logprobs
    assert ours.dtype == torch.float32
    plain_err = (plain32.double() - exact).abs().max()
    our_err = (ours.double() - exact).abs().max()
    assert our_err <= 2 * plain_err + 1e-6, (float(our_err), float(plain_err))


def _head_model(model_type, **overrides):
    """``tiny_model(model_type)``, built with eager attention and its plain forward on SDPA (float64-exact)."""
    model = tiny_model(model_type, attn="eager", **overrides)
    model.config._attn_implementation_internal = "sdpa"  # float64-exact reference attention
    return model


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=3.0, sliding_window=4096)),
        ("granite", dict(logits_scaling=4.0)),
        ("cohere", dict(logit_scale=0.3)),
    ],
    ids=["gemma2_final_softcap", "granite_logits_scaling", "cohere_logit_scale"],
)
def test_head_post_processing_matches_model_forward(model_type, kw):
    # Cohere's rotary casts q/k to float32 even in a float64 model, so gradients summed over
    # completions sharing a prompt would round differently there; one completion per group
    # keeps the comparison about the head (logit_scale), which is what this test is for.
    layout = ([5, 3], [[3], [2]]) if model_type == "cohere" else ([5, 3], [[3, 4], [2]])
    _check(_head_model(model_type, **kw), random_groups(0, 2, *layout))


def test_sliding_window_handled_exactly():
    groups = random_groups(0, 2, [9, 3], [[6, 4], [5]])
    model = tiny_model("mistral", sliding_window=4)
    _check(model, groups)
    # the window really bites here: without it the log-probs differ
    wide = tiny_model("mistral", sliding_window=None)
    with torch.no_grad():
        assert (sp.logprobs(wide, groups).logprobs - sp.logprobs(model, groups).logprobs).abs().max() > 1e-4


def test_gemma2_sliding_layers_exact():
    model = _head_model("gemma2", attn_logit_softcapping=None, sliding_window=3)
    _check(model, random_groups(1, 2, [6, 2], [[4, 2], [5]]))


def test_no_grad_returns_no_graph():
    model = tiny_model("llama")
    with torch.no_grad():
        out = sp.logprobs(model, random_groups(0, 1, [5], [[2, 3]]))
    assert not out.logprobs.requires_grad


def test_attention_setting_restored_also_on_error():
    model = tiny_model("llama")
    sp.logprobs(model, random_groups(0, 1, [5], [[2, 3]]))
    assert model.config._attn_implementation == "sdpa"

    def boom(*a, **k):
        raise RuntimeError("boom")

    model.model.norm.register_forward_hook(sp.allow_hook(boom))
    with pytest.raises(RuntimeError, match="boom"):
        sp.logprobs(model, random_groups(0, 1, [5], [[2, 3]]))
    assert model.config._attn_implementation == "sdpa"
    assert all(m.config._attn_implementation == "sdpa" for m in model.modules() if hasattr(m, "config"))


def test_window_kept_on_the_module_is_applied(kernel_path):
    """Qwen2-MoE keeps its sliding window on the attention module and applies it through the mask only."""
    model = _head_model(
        "qwen2_moe",
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    model.config._experts_implementation_internal = "eager"
    assert any(getattr(m, "sliding_window", None) == 4 for m in model.modules())
    groups = random_groups(0, 2, [9, 3], [[6, 4], [5]])
    ref, _ = plain_logprobs(model, groups)
    with torch.no_grad():
        assert (sp.logprobs(model, groups).logprobs - ref).abs().max() <= 1e-9
    # the MoE router's softmax runs in float32 even in a float64 model, so gradients summed over completions
    # round at float32 there: 1e-6 relative, still far below what a missing window changes
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum())
    got = grads_of(model, lambda: (sp.logprobs(model, groups).logprobs * w).sum())
    assert_grads_close(got, want, 1e-6)


@pytest.mark.parametrize("kernel_path", ["cpu", pytest.param("reference", marks=pytest.mark.slow)], indirect=True)
def test_full_layers_ignore_a_window_left_on_the_module(kernel_path):
    """Exaone4 keeps config.sliding_window on every attention module but passes sliding_window=None on its
    full-attention layers: which layers slide comes from config.layer_types, never from the module attribute."""
    model = _head_model(
        "exaone4",
        sliding_window=3,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    assert all(
        getattr(m, "sliding_window", None) == 3 for m in model.modules() if type(m).__name__.endswith("Attention")
    )
    _check(model, random_groups(0, 2, [9, 3], [[6, 4], [5]]))


def test_a_window_the_layer_passes_must_agree_with_layer_types():
    model = _head_model(
        "exaone4",
        sliding_window=3,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    model.config.layer_types = ["full_attention", "full_attention"]  # now layer 0 passes a window its type denies
    with pytest.raises(ValueError, match=r"passes sliding_window=3 to attention, but config.layer_types says 'full"):
        sp.logprobs(model, random_groups(0, 1, [9], [[6, 4]]))
