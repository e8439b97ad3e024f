"""PEFT/LoRA models go through sharedprefix exactly (the adapter layers are part of the unwrapped model)."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model

peft = pytest.importorskip("peft")


def test_lora_model_float64_exact_with_budget():
    base = tiny_model("llama")
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False),
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
