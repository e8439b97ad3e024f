"""Tiny hybrid models in float64 (the configs of ``test_hybrid``, the zoo's with weights of std 0.2, the Mamba2 and
3-layer delta-net/convolution cuts), their prompt groups, the depth-4 trie, and the checks of groups and trees
against one plain forward per row (log-probs 1e-9, gradients relative 1e-9)."""

import pytest
import torch
import transformers

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.schedule.cache import PrefixCache
from sharedprefix.tools.reference import Float64Inside
from sharedprefix.tools.zoo.configs import float64_norms
from support.trees import plain_rows

# initializer_range 0.2 (not 0.02): states that matter, so that a completion started from a wrong one is caught
COMMON = dict(
    initializer_range=0.2,
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_chunk_size=4,
            mamba_n_groups=1,
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            head_dim=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
}
MODELS = {}


def model_of(family):
    """The tiny float64 model of ``family`` (``CONFIGS``, else the zoo's via ``zoo_model``), built once and cached."""
    if family not in MODELS and family not in CONFIGS:  # a zoo entry (the cache path's example, Zaya)
        MODELS[family] = zoo_model(family)
    if family not in MODELS:
        cfg_cls, model_cls, extra = CONFIGS[family]
        cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)._from_config(cfg, attn_implementation="sdpa")
        model.config._experts_implementation = "eager"
        model = model.to(torch.float64).eval()
        float64_norms(model)
        MODELS[family] = model
    return MODELS[family]


def groups_of(seed=0):
    """Three groups of random ids: a 9-token prompt with 4 completions, a 1-token prompt with 2, a 5-token with 1."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, COMMON["vocab_size"], (n,), generator=g)  # noqa: E731
    return [
        sp.Group(ids(9), [ids(5), ids(3), ids(6), ids(1)]),
        sp.Group(ids(1), [ids(4), ids(2)]),
        sp.Group(ids(5), [ids(3)]),
    ]


def zoo_model(entry, **config):
    """A zoo entry built as the zoo builds it but with weights of std 0.2 (states that matter; Zaya's key scale, zero at
    init, near 1), float64 norms and
    decay factors (MiniMax's block prefill, all of a plain row, reads decays rounded to float32 at init, and its
    token-by-token continuation, our completions, recomputes them in the model's dtype: 1e-8 apart in a float64 model
    unless the buffers are float64 too). ``config``: settings to change on the zoo's config."""
    from sharedprefix.tools import zoo

    cfg = zoo.tiny_config(entry)
    for k, v in config.items():
        setattr(cfg, k, v)
    for c in zoo.configs.all_configs(cfg):
        c.initializer_range = 0.2
    torch.manual_seed(0)
    cls = getattr(transformers, zoo.entries()[entry])
    model = cls._from_config(cfg, attn_implementation="sdpa" if cls._supports_sdpa else "eager")
    model.config._experts_implementation = "eager"
    model = model.to(torch.float64).eval()
    float64_norms(model)
    with torch.no_grad():  # Zaya scales its keys by a learned factor that starts at zero: keys would not matter
        for name, p in model.named_parameters():
            if name.endswith("qk_norm.temp"):
                p.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(0))
    for mod in model.modules():  # MiniMax: decays computed in float32 at init, recomputed in float64 by its decode
        if hasattr(mod, "decay_factors"):
            for buf, value in zip(
                (mod.query_decay, mod.key_decay, mod.diagonal_decay), mod.decay_factors(mod.slope_rate)
            ):
                buf.copy_(value)
    return model


# a system prompt, two prompts below it, completions below those, one completion with a second turn: depth 4
DEEP_ROWS = [
    [5, 6, 7, 8, 9, 10, 11, 12] + p + c
    for p in ([20, 21, 22], [23, 24])
    for c in ([30, 31], [32, 33, 34], [30, 31, 40, 41, 42], [30, 31, 40, 43])
]


def groups_check(model, gs, runs):
    """Log-probs (1e-9) and ``sp.backward``'s gradients (relative 1e-9) for each (budget, mode) of ``runs``, against
    one plain forward per row computed once."""
    ref = plain_logprobs(model, gs)[0].detach()
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
    for budget, mode in runs:
        with torch.no_grad():
            out = sp.logprobs(model, gs, max_tokens=budget)
        assert float((out.logprobs - ref).abs().max()) <= 1e-9, (budget, mode)
        got = grads_of(
            model,
            lambda b=budget, m=mode: (
                sp.backward(model, gs, lambda x: (x.logprobs * w[x.index]).sum(), max_tokens=b, prefix_activations=m)
                and None
            ),
        )
        assert_grads_close(got, want, 1e-9)


def tree_check(model, rows, trained, budgets, modes):
    """Log-probs (1e-9) of the tree of ``rows`` under each budget, and ``sp.backward``'s gradients (relative 1e-9) under
    each budget and mode, against one plain forward per row."""
    tree = sp.Tree.from_rows(rows, trained)
    ref = plain_rows(model, rows, trained).detach()
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(rows)))
    want = grads_of(model, lambda: (plain_rows(model, rows, trained) * w).sum())
    nothing = all(float(g.abs().max()) == 0 for g in want.values())
    for budget in budgets:
        with torch.no_grad():
            out = sp.logprobs(model, tree, max_tokens=budget)
        assert float((out.logprobs - ref).abs().max()) <= 1e-9, budget
        for mode in modes:
            got = grads_of(
                model,
                lambda b=budget, m=mode: (
                    sp.backward(
                        model, tree, lambda x: (x.logprobs * w[x.index]).sum(), max_tokens=b, prefix_activations=m
                    )
                    and None
                ),
            )
            if nothing:
                assert all(float(g.abs().max()) == 0 for g in got.values())
            else:
                assert_grads_close(got, want, 1e-9)


def logprob_error(model, gs, budget):
    """Max |log-prob - plain| of ``sp.logprobs`` under ``budget``."""
    ref = plain_logprobs(model, gs)[0].detach()
    with torch.no_grad():
        return float((sp.logprobs(model, gs, max_tokens=budget).logprobs - ref).abs().max())


def assert_detached_state_caught(monkeypatch, model, gs, budget=6):
    """The control that cached states must stay on the graph: with the prefix cache's conv tails and recurrent states
    read detached, the log-probs stay exact but the gradient later passes send into the prompt through them is lost,
    and the gradient comparison must catch it."""
    read = PrefixCache.read_state
    monkeypatch.setattr(PrefixCache, "read_state", lambda self, slot, seg: read(self, slot, seg).detach())
    with Float64Inside():
        assert logprob_error(model, gs, budget) <= 1e-9
        ref = plain_logprobs(model, gs)[0].detach()
        w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        want = grads_of(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
        loss = lambda b: (b.logprobs * w[b.index]).sum()  # noqa: E731
        got = grads_of(model, lambda: sp.backward(model, gs, loss, max_tokens=budget) and None)
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close(got, want, 1e-6)


# -- Mamba2-family hybrids (test_hybrid_ssm) --------------------------------------------------------------------
SSM_CHUNK = {"falcon_h1": "mamba_chunk_size", "bamba": "mamba_chunk_size", "granitemoehybrid": "mamba_chunk_size"}
SSM_MUP = dict(  # Falcon-H1's multipliers, none of them 1, so that a path that dropped one would be caught
    key_multiplier=0.7,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.9,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
    mlp_multipliers=[1.2, 0.8],
    embedding_multiplier=1.5,
)
# Nemotron-H's zoo sizes keep its defaults' Mamba2 widths (128 heads of 64 x 128 states): cut to the others' sizes
SSM_SMALL = {
    "nemotron_h": dict(
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, moe_shared_expert_intermediate_size=16
    )
}
SSM_MODELS: dict = {}


def ssm_model(family):
    """The zoo's Mamba2-family model with a scan chunk of 4 tokens (Falcon-H1 with ``SSM_MUP``, Nemotron-H cut to
    ``SSM_SMALL``), built once and cached."""
    if family not in SSM_MODELS:
        extra = SSM_MUP if family == "falcon_h1" else SSM_SMALL.get(family, {})
        SSM_MODELS[family] = zoo_model(family, **{SSM_CHUNK.get(family, "chunk_size"): 4}, **extra)
    return SSM_MODELS[family]


# -- 3-layer cuts of the zoo's convolution and delta-net hybrids (test_hybrid_linear) ----------------------------
LA, FA, SA = "linear_attention", "full_attention", "sliding_attention"
SMALL = {  # 3 layers each; the delta nets as small as the attention
    "lfm3": dict(layer_types=["conv", SA, "conv"], conv_L_cache=3),
    "lara_mini": dict(
        layer_types=[LA, SA, LA],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "kimi_linear": dict(layer_types=[LA, FA, LA], mlp_layer_types=["dense", "sparse", "dense"]),
    "bailing_hybrid": dict(layer_types=[LA, FA, LA], mlp_layer_types=["dense", "sparse", "sparse"], layer_group_size=3),
}
# Bailing's lists (5.25): cut to 3 layers too
PER_LAYER = (
    "expert_swiglu_limit_list",
    "share_expert_swiglu_limit_list",
)
LINEAR_MODELS: dict = {}


def linear_model(family):
    """The zoo's tiny config of ``family`` cut to 3 layers (``SMALL``), weights of std 0.2, float64 norms."""
    from sharedprefix.tools import zoo

    if family not in LINEAR_MODELS:
        base = zoo.tiny_config(family)
        kw = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "transformers_version")}
        kw.update(SMALL[family], num_hidden_layers=3, initializer_range=0.2)
        kw.update({k: kw[k][:3] for k in PER_LAYER if k in kw})
        cls = getattr(transformers, zoo.entries()[family])
        torch.manual_seed(0)
        model = cls._from_config(type(base)(**kw), attn_implementation="sdpa" if cls._supports_sdpa else "eager")
        model.config._experts_implementation = "eager"
        model = model.to(torch.float64).eval()
        float64_norms(model)
        LINEAR_MODELS[family] = model
    return LINEAR_MODELS[family]
