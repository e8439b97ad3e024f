"""SharedPrefixGRPOTrainer refuses at construction what it cannot compute exactly, and each message's advice, once
followed, lets the trainer be built."""

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import transformers as tf  # noqa: E402

from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from sharedprefix.tools.zoo.configs import tiny_config  # noqa: E402
from support.grpo import build_trainer, lfm2_model, qwen3_model, tiny_for_tokenizer  # noqa: E402


def test_settings_of_our_own_are_checked_with_the_fix(tmp_path):
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="sharedprefix_prefix_activations='nope'; expected one of"):
        build_trainer(qwen3_model(tok), tok, tmp_path, sharedprefix_prefix_activations="nope")
    with pytest.raises(ValueError, match="sharedprefix_max_tokens=0; expected a positive int"):
        build_trainer(qwen3_model(tok), tok, tmp_path, sharedprefix_max_tokens=0)
    assert build_trainer(
        qwen3_model(tok), tok, tmp_path, sharedprefix_max_tokens=64, sharedprefix_prefix_activations="recompute"
    )


def test_cache_path_hybrid_under_gradient_checkpointing_is_refused_when_built(tmp_path):
    """TRL turns gradient checkpointing on by default; a hybrid on the cache path (Zaya's convolution and recurrent
    layers) needs the model's cache, which transformers turns off under it. Refused at construction, with the setting
    to change; hybrids on the packed path (LFM2's short convolutions, Falcon-H1's Mamba2 mixers) are built with
    checkpointing on."""
    tok = build_tokenizer()
    with pytest.raises(ValueError, match=r"ZayaForCausalLM is a hybrid model .*Set gradient_checkpointing=False"):
        build_trainer(tiny_for_tokenizer("zaya", tok, tf.ZayaForCausalLM), tok, tmp_path)
    assert build_trainer(
        tiny_for_tokenizer("zaya", tok, tf.ZayaForCausalLM), tok, tmp_path, gradient_checkpointing=False
    )
    assert build_trainer(lfm2_model(tok), tok, tmp_path)
    assert build_trainer(tiny_for_tokenizer("falcon_h1", tok, tf.FalconH1ForCausalLM), tok, tmp_path)


def test_qwen3_5_vision_language_model_is_built_on_the_packed_path(tmp_path):
    """Qwen3.5's vision-language model wraps a hybrid text model whose gated delta-nets run on the packed path: the
    trainer is built for it, with TRL's default gradient checkpointing (it was refused by its wrapper's type)."""
    tok = build_tokenizer()
    text = tiny_config("qwen3_5_text")
    text.vocab_size = len(tok)
    text.bos_token_id, text.eos_token_id, text.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text.hidden_size, patch_size=4
    )
    torch.manual_seed(0)
    vlm = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    assert build_trainer(vlm, tok, tmp_path)


def test_moe_aux_loss_on_a_cache_path_hybrid_is_refused_when_built(tmp_path):
    """A hybrid MoE on the cache path (MiniMax's lightning attention layers) with router_aux_loss_coef != 0: that path
    reads no router logits. Refused when built, with the setting to change."""
    tok = build_tokenizer()
    model = tiny_for_tokenizer("minimax", tok, tf.MiniMaxForCausalLM)
    with pytest.raises(
        ValueError, match=r"hybrid model with an MoE load-balancing loss .*Set router_aux_loss_coef=0.0"
    ):
        build_trainer(model, tok, tmp_path, gradient_checkpointing=False, router_aux_loss_coef=0.01)
    assert build_trainer(model, tok, tmp_path, gradient_checkpointing=False, router_aux_loss_coef=0.0)


def test_fp16_is_refused_with_bf16_as_the_fix(tmp_path):
    tok = build_tokenizer()
    with pytest.raises(ValueError, match=r"fp16=True .*Use bf16=True"):
        build_trainer(qwen3_model(tok), tok, tmp_path, fp16=True)
    assert build_trainer(qwen3_model(tok), tok, tmp_path, bf16=True)


def test_a_tensor_parallel_model_is_refused_with_the_reason(tmp_path):
    """TRL's GRPOTrainer runs tensor parallelism through accelerate's ParallelismConfig, which refuses CPU processes,
    so the trainer was never compared with GRPOTrainer under it: a model transformers loaded with a tp_plan (its
    ``_tp_size``, set here on a built trainer's model, as a 2-process load sets it) is refused, naming the way out."""
    tok = build_tokenizer()
    trainer = build_trainer(qwen3_model(tok), tok, tmp_path)
    trainer.model._tp_size = 2
    with pytest.raises(
        ValueError, match=r"tensor-parallel \(tp_size=2\).*ParallelismConfig.*MULTI_CPU.*without tp_plan"
    ):
        trainer._refuse_at_construction()


def test_dropout_that_trl_keeps_on_is_refused_when_built(tmp_path):
    """TRL trains in training mode, with disable_dropout=False by default (TRL 1.16), and its disable_dropout=True
    zeroes torch.nn.Dropout modules only: an attention_dropout in the config, or any dropout under
    disable_dropout=False (LoRA's included), would share one draw across a group's prompt. Refused when built (before:
    at the first training step), naming the settings; the control: LoRA's dropout under disable_dropout=True is zeroed
    by TRL, and the trainer builds."""
    peft = pytest.importorskip("peft")
    tok = build_tokenizer()
    model = qwen3_model(tok)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention_dropout=0.1.*Set disable_dropout=True and attention_dropout=0.0"):
        build_trainer(model, tok, tmp_path, disable_dropout=True)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"dropout p=0.1 at .*lora_dropout.*\(disable_dropout=False;"):
        build_trainer(qwen3_model(tok), tok, tmp_path, peft_config=peft.LoraConfig(**lora))  # TRL's default
    assert build_trainer(qwen3_model(tok), tok, tmp_path, disable_dropout=True, peft_config=peft.LoraConfig(**lora))


@pytest.mark.parametrize("trl", ["grpo", "rloo"])
def test_reentrant_checkpointing_with_a_budget_is_refused_when_built(tmp_path, trl):
    """Under reentrant gradient checkpointing a pass that splits a group is refused (its cached prompt K/V would get
    no gradient), and whether a step's groups fit ``sharedprefix_max_tokens`` depends on the lengths it brings: the
    two together are refused when built (before: at the first step with a group over the budget), naming the values
    and the settings that remove it; each of those settings builds."""
    from sharedprefix.integrations.trl import SharedPrefixRLOOConfig, SharedPrefixRLOOTrainer

    rloo = dict(trainer_cls=SharedPrefixRLOOTrainer, config_cls=SharedPrefixRLOOConfig, beta=0.0)  # no reference
    cls = {} if trl == "grpo" else rloo
    tok = build_tokenizer()
    reentrant = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    name = "GRPOTrainer" if trl == "grpo" else "RLOOTrainer"
    with pytest.raises(
        ValueError,
        match=r"gradient_checkpointing_kwargs=\{'use_reentrant': True\} \(reentrant\) and sharedprefix_max_tokens=16: "
        rf".*so {name} with these settings is refused when built\. Expected use_reentrant=False with a budget\. Set "
        r"gradient_checkpointing_kwargs=\{'use_reentrant': False\} .*sharedprefix_max_tokens=None",
    ):
        build_trainer(qwen3_model(tok), tok, tmp_path, sharedprefix_max_tokens=16, **reentrant, **cls)
    with pytest.raises(ValueError, match=r"\{'preserve_rng_state': True\} \(reentrant: torch's checkpoint is where"):
        build_trainer(
            qwen3_model(tok), tok, tmp_path, sharedprefix_max_tokens=16,
            gradient_checkpointing_kwargs={"preserve_rng_state": True}, **cls,
        )  # fmt: skip
    assert build_trainer(qwen3_model(tok), tok, tmp_path, **reentrant, **cls)  # no budget: one pass, as TRL
    non_reentrant = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert build_trainer(qwen3_model(tok), tok, tmp_path, sharedprefix_max_tokens=16, **non_reentrant, **cls)


def test_fsdp_settings_it_cannot_run_are_refused_with_the_reason(tmp_path, monkeypatch):
    """accelerate's FSDP plugin as the trainer's constructor reads it (``trl_checks.check_fsdp``; accelerate takes the
    plugin only with a distributed accelerator backend, so it is set here on a built trainer): FSDP1 refused; under
    FSDP2 the policy passes run in "recompute", and vision-language and cache-path hybrid models are refused. The
    refusals reached through the constructor (MoE load-balancing loss, "offload") and the FSDP2 runs themselves are
    in tests/parallel/test_trl_fsdp.py."""
    from types import SimpleNamespace

    from sharedprefix.integrations.trl_checks import check_fsdp

    tok = build_tokenizer()
    trainer = build_trainer(qwen3_model(tok), tok, tmp_path)
    inner = trainer.model
    assert check_fsdp(trainer, inner, False, "keep") == "keep"  # no FSDP: the setting as it is

    def fsdp(version):
        state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version))
        monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(state=state))
        monkeypatch.setattr(trainer, "is_fsdp_enabled", True)

    fsdp(1)
    with pytest.raises(ValueError, match=r"fsdp_version=1: sharedprefix runs under FSDP2 .*'fsdp_version': 2"):
        check_fsdp(trainer, inner, False, "keep")
    fsdp(2)
    assert check_fsdp(trainer, inner, False, "keep") == "recompute"
    assert check_fsdp(trainer, inner, False, "recompute") == "recompute"
    with pytest.raises(ValueError, match=r"FSDP2 .*hybrid model on sharedprefix's cache path.*refused when built"):
        check_fsdp(trainer, inner, True, "keep")

    class VisionLanguage:
        config = SimpleNamespace(get_text_config=lambda: SimpleNamespace())

    with pytest.raises(ValueError, match=r"FSDP2 .*VisionLanguage is a vision-language model.*text path only"):
        check_fsdp(trainer, VisionLanguage(), False, "keep")
