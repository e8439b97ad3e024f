"""PEFT adapters on the input embedding and the LM head: a LoRA ``Embedding`` wrapper declares no
``num_embeddings`` (and its ``out_features`` is the embedding width), which the vocabulary check read directly and
crashed on (found by ``tests/invariant/test_fuzz.py``'s neighbourhood). Each adapter placement gives the plain
per-row log-probs and gradients in float64."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model

peft = pytest.importorskip("peft")

GROUPS = [sp.Group([1, 2, 3, 96, 0], [[4, 5], [6], [7, 8, 9]]), sp.Group([5], [[1, 96]])]


@pytest.mark.parametrize(
    "adapter",
    [
        dict(target_modules=["q_proj", "embed_tokens"]),
        dict(target_modules=["q_proj", "lm_head"]),
        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    ],
    ids=["lora_embedding", "lora_head", "modules_to_save"],
)
def test_adapters_on_embedding_and_head_match_plain_rows(adapter):
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=2, init_lora_weights=False, **adapter))
    model = model.double()
    with torch.no_grad():  # the saved copies differ from the originals, so that reading the wrong one shows
        for n, p in model.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.1 * torch.randn_like(p))
    ref = plain_logprobs(model, GROUPS)[0].detach()
    with torch.no_grad():
        assert (sp.logprobs(model, GROUPS).logprobs - ref).abs().max() <= 1e-9
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
    got = grads_of(
        model, lambda: sp.backward(model, GROUPS, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6) and None
    )
    assert_grads_close(got, want, 1e-9)


def test_token_ids_beyond_a_lora_embedding_are_refused_by_the_vocabulary():
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=2, target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match="97"):
        sp.logprobs(model.double(), [sp.Group([1, 97], [[2]])])


def test_deferred_logprobs_refuse_a_backward_with_other_adapters():
    """A deferred call's backward recomputes its forward: computed inside ``disable_adapter()`` and backpropagated
    after it, that forward would run the adapter, so the gradient would be the adapter-on model's. Refused; inside the
    block it is the plain adapter-off gradient."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("qwen3"), lora).double()
    model.requires_grad_(True)
    with model.disable_adapter():
        ref = plain_logprobs(model, GROUPS)[0].detach()
        w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
        got = grads_of(model, lambda: (sp.logprobs(model, GROUPS, max_tokens=6, defer=True).logprobs * w).sum())
        out = sp.logprobs(model, GROUPS, max_tokens=6, defer=True)
    assert_grads_close(got, want, 1e-9)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"other PEFT adapters .* \(adapters disabled: True then, False now; .*same "):
        (out.logprobs * w).sum().backward()
    assert all(p.grad is None for p in model.parameters())


T = ["q_proj", "v_proj", "down_proj"]
TUNERS = {  # PEFT's methods that change weights (tuner layers), each with a non-identity initialisation
    "lokr": lambda: peft.LoKrConfig(target_modules=T, init_weights=False),
    "loha": lambda: peft.LoHaConfig(target_modules=T, init_weights=False),
    "oft": lambda: peft.OFTConfig(target_modules=T, r=4, oft_block_size=0, init_weights=False),
    "vera": lambda: peft.VeraConfig(target_modules=["q_proj", "v_proj"], init_weights=False),
    "adalora": lambda: peft.AdaLoraConfig(target_modules=T, init_lora_weights=False, total_step=10),
    "ln_tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm", "norm"]),
    "trainable_tokens": lambda: peft.LoraConfig(target_modules=["q_proj"], trainable_token_indices=[1, 2, 96]),
}


@pytest.mark.parametrize("tuner", list(TUNERS))
def test_peft_tuner_methods_match_plain_rows(tuner):
    """Tuner layers act on each token alone: exact under a budget that splits the first group's prompt."""
    model = peft.get_peft_model(tiny_model("qwen3"), TUNERS[tuner]()).double()
    with torch.no_grad():  # away from any identity initialisation, so that a dropped adapter shows
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    ref = plain_logprobs(model, GROUPS)[0].detach()
    with torch.no_grad():
        assert (sp.logprobs(model, GROUPS).logprobs - ref).abs().max() <= 1e-9
        with model.disable_adapter():  # the adapter matters
            assert (plain_logprobs(model, GROUPS)[0] - ref).abs().max() > 1e-4
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
    got = grads_of(
        model, lambda: sp.backward(model, GROUPS, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6) and None
    )
    assert_grads_close(got, want, 1e-9)


PROMPT_LEARNING = {
    "PROMPT_TUNING": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "PREFIX_TUNING": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "P_TUNING": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8),
}


@pytest.mark.parametrize("kind", list(PROMPT_LEARNING))
def test_prompt_learning_adapters_are_refused(kind):
    """PeftModel.forward puts virtual tokens before every row (embeddings, or K/V in every layer): the base model's
    run, which sharedprefix's is, gives other log-probs (the control), so each call refuses the model."""
    model = peft.get_peft_model(tiny_model("qwen3"), PROMPT_LEARNING[kind]())
    row = torch.tensor([[*GROUPS[0].prompt, *GROUPS[0].completions[0]]])
    with torch.no_grad():
        peft_logits = model(input_ids=row).logits[0, -row.shape[1] :]
        assert (peft_logits - model.get_base_model()(input_ids=row).logits[0]).abs().max() > 1e-3
    match = rf"active adapter is {kind} \(a prompt-learning method, 3 virtual tokens"
    with pytest.raises(ValueError, match=match):
        sp.logprobs(model, GROUPS)
    with pytest.raises(ValueError, match=match):
        sp.backward(model, GROUPS, lambda b: b.logprobs.sum())
    with pytest.raises(ValueError, match=match):
        sp.plan_call(model, GROUPS)
