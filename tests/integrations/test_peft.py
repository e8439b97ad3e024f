"""PEFT/LoRA models go through sharedprefix exactly (the adapter layers are part of the unwrapped model)."""

import copy

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model

peft = pytest.importorskip("peft")


def test_lora_model_float64_exact_with_budget():
    base = tiny_model("llama")
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            lora_dropout=0.0,
            init_lora_weights=False,
        ),
    )
    model.double()
    groups = random_groups(0, 2, [14, 5], [[3, 4, 2], [6, 1]])
    W = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())
    assert any("lora_" in n for n in want)
    for budget in (None, 9):
        model.zero_grad(set_to_none=True)
        sp.backward(model, groups, lambda b: (b.logprobs * W[b.index] * b.mask).sum(), max_tokens=budget)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert_grads_close(got, want, 1e-9)


@pytest.mark.parametrize("family", [pytest.param("qwen3_5_text", marks=pytest.mark.slow), "lfm2"])
def test_lora_on_a_hybrid_packed_path_float64_exact(family):
    """LoRA on every linear layer of a hybrid (Qwen3.5's delta-net projections in_proj_qkv/z/a/b, LFM2's conv
    in_proj; out_proj left out, as PEFT refuses it on Mamba-like models): the PeftModel's packed path, its
    mixers' seams reached through the wrapper, equals one plain forward per row, whole and under a budget that
    splits a group."""
    from helpers import assert_matches_plain_rows
    from sharedprefix.tools.reference import Float64Inside
    from support.hybrid import groups_of, model_of

    base = copy.deepcopy(model_of(family))  # PEFT freezes the base model's parameters: not the shared one's
    names = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)} - {
        "lm_head",
        "out_proj",
    }
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(names), lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, cfg).double()
    with Float64Inside():  # Qwen3.5's gated delta rule computes in float32 otherwise
        for budget in (None, 7):
            got = assert_matches_plain_rows(model, groups_of(), budget=budget)
    assert any("lora_" in n and "in_proj" in n for n in got)
