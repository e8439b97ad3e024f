"""SharedPrefixRLOOTrainer against TRL's RLOOTrainer: same seed, same data, same parameters after ``train()``.

RLOO samples k completions per prompt, baselines each reward by the mean of the other k - 1, and trains on the
sequence-level ratio ``exp(sum(logp) - sum(old_logp))`` clipped as PPO does. The hooks (``SharedPrefixHooks``) are the
GRPO trainer's; these tests run RLOO's own loss through them.

The float64 reference is RLOOTrainer with a plain transformers forward of each row as its hook (``plain_rows``), and
every run of a float64 test computes Qwen3's RMSNorm in float64 (``float64_qwen3_norms``; transformers' rounds to
float32). TRL's own fused LM head computes log-probs in float32 even for a float64 model, so a float64 RLOOTrainer
agrees with an exact run to float32 rounding only (measured: 6e-7 of the update). Ours agrees with the reference to
a relative 1e-9 of the update (measured: 3e-15), and with RLOOTrainer itself to 1e-5; bf16 runs by the 2x rule
against the reference.
"""

import pytest
import torch

import sharedprefix as sp
from tests.helpers import call_source

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import RLOOConfig, RLOOTrainer  # noqa: E402

from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOTrainer,
    SharedPrefixHooks,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import (  # noqa: E402
    build_trainer,
    float64_qwen3_norms,
    moe_model,
    plain_rows,
    qwen3_model,
    train_two_steps,
)

PLAIN, OURS = (RLOOTrainer, RLOOConfig), (SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig)
EXACT = (plain_rows(RLOOTrainer), RLOOConfig)  # the float64 reference, with float64_qwen3_norms
F64 = {"model_init_kwargs": {"dtype": torch.float64}}  # TRL loads the policy and the reference in float64


def _saved(tmp_path, model):
    model.save_pretrained(tmp_path / "init")
    return str(tmp_path / "init"), {n: p.detach().clone() for n, p in model.named_parameters()}


def _delta(trainer, init, only=None):
    return torch.cat(
        [
            (p.detach().double() - init[n].double()).flatten()
            for n, p in trainer.model.named_parameters()
            if only is None or only in n
        ]
    )


def _spy(monkeypatch):
    """Record every ``sp.logprobs`` call's source and settings (until ``monkeypatch`` is undone)."""
    calls = []
    logprobs = sp.logprobs

    def spy(model, source, **kw):
        calls.append((call_source(source), kw))
        return logprobs(model, source, **kw)

    monkeypatch.setattr(sp, "logprobs", spy)
    return calls


def test_rloo_shares_the_hooks_and_refuses_what_grpo_refuses(tmp_path):
    """One set of hooks for both trainers (no second copy), and the construction-time refusals, each with its fix."""
    for name in ("_get_per_token_logps_and_entropies", "_prepare_inputs", "_refuse_at_construction", "__init__"):
        assert getattr(SharedPrefixRLOOTrainer, name) is getattr(SharedPrefixHooks, name)
        assert getattr(SharedPrefixGRPOTrainer, name) is getattr(SharedPrefixHooks, name)
    tok = build_tokenizer()
    build = lambda **kw: build_trainer(  # noqa: E731
        qwen3_model(tok),
        tok,
        tmp_path,
        trainer_cls=SharedPrefixRLOOTrainer,
        config_cls=SharedPrefixRLOOConfig,
        beta=0.0,
        **kw,
    )
    with pytest.raises(ValueError, match="sharedprefix_prefix_activations='nope'; expected one of"):
        build(sharedprefix_prefix_activations="nope")
    with pytest.raises(ValueError, match="sharedprefix_max_tokens=0; expected a positive int"):
        build(sharedprefix_max_tokens=0)
    with pytest.raises(ValueError, match=r"fp16=True .*not supported by SharedPrefixRLOOTrainer.*Use bf16=True"):
        build(fp16=True)
    trainer = build(sharedprefix_max_tokens=64, sharedprefix_prefix_activations="recompute")
    assert trainer._sp_budget == 64 and trainer._sp_mode == "recompute"
    trainer.model._tp_size = 2
    with pytest.raises(ValueError, match=r"tensor-parallel \(tp_size=2\).*TRL's RLOOTrainer with it needs"):
        trainer._refuse_at_construction()


@pytest.mark.slow
def test_float64_parameters_equal_rloo_trainers_under_a_budget_that_splits_groups(tmp_path, monkeypatch):
    """beta 0.1 (reference log-probs through sharedprefix too), two steps, groups of 4 under a 24-token budget that
    splits every group (prompts of about 20 tokens): float64 parameters equal the exact RLOO run's to a relative 1e-9,
    and RLOOTrainer's (float32 head) to 1e-5."""
    float64_qwen3_norms(monkeypatch)
    tok = build_tokenizer()
    init, state = _saved(tmp_path, qwen3_model(tok))
    exact = train_two_steps(*EXACT, init, tok, tmp_path / "exact", beta=0.1, **F64)
    assert next(exact.model.parameters()).dtype == torch.float64
    plain = train_two_steps(*PLAIN, init, tok, tmp_path / "plain", beta=0.1, **F64)
    budget = dict(sharedprefix_max_tokens=24, sharedprefix_prefix_activations="recompute")
    with pytest.MonkeyPatch.context() as spying:
        calls = _spy(spying)
        ours = train_two_steps(*OURS, init, tok, tmp_path / "sp", beta=0.1, **budget, **F64)
    deferred = [src for src, kw in calls if kw.get("defer")]
    assert deferred and all(isinstance(s, sp.Tree) and sp.plan(s, 24).splits for s in deferred)
    de, dp, do = _delta(exact, state), _delta(plain, state), _delta(ours, state)
    scale = float(de.abs().max())
    assert scale > 1e-3  # the parameters moved
    err = float((do - de).abs().max())
    assert err <= 1e-9 * scale, (err, scale)
    assert float((do - dp).abs().max()) <= 1e-5 * scale  # RLOOTrainer itself, to its head's float32 rounding


@pytest.mark.slow
def test_bf16_by_the_2x_rule_against_the_float64_run(tmp_path, monkeypatch):
    """bf16 mixed precision (accelerate's autocast over float32 weights), one step with a splitting budget: our
    update's error against the exact float64 run's is at most twice the plain bf16 RLOOTrainer's."""
    float64_qwen3_norms(monkeypatch)  # float32 norms (the bf16 runs' residual stream) compute as before
    tok = build_tokenizer()
    init, state = _saved(tmp_path, qwen3_model(tok))
    one = dict(max_steps=1, beta=0.1)
    ref = _delta(train_two_steps(*EXACT, init, tok, tmp_path / "ref", **one, **F64), state)
    mixed = dict(bf16=True, **one)
    plain = _delta(train_two_steps(*PLAIN, init, tok, tmp_path / "plain", **mixed), state)
    ours = _delta(train_two_steps(*OURS, init, tok, tmp_path / "sp", sharedprefix_max_tokens=24, **mixed), state)
    scale = float(ref.abs().max())
    plain_err, our_err = float((plain - ref).abs().max()), float((ours - ref).abs().max())
    assert scale > 1e-3 and plain_err > 0
    assert plain_err < 0.1 * scale  # the same completions were sampled: bf16 rounding, not another batch
    assert our_err <= 2 * plain_err, (our_err, plain_err, scale)


@pytest.mark.slow
def test_lora_with_gradient_checkpointing_equals_rloo_trainer(tmp_path, monkeypatch):
    """PEFT LoRA under TRL's default gradient checkpointing (deferred policy pass), float64: the adapters' update
    equals the exact run's to a relative 1e-9; beta 0.1 takes the reference log-probs with the adapter disabled."""
    peft = pytest.importorskip("peft")
    float64_qwen3_norms(monkeypatch)
    tok = build_tokenizer()
    init, _ = _saved(tmp_path, qwen3_model(tok))
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    runs = []
    for cls, cfg_cls in (EXACT, OURS):
        t = train_two_steps(
            cls, cfg_cls, init, tok, tmp_path / cls.__name__, beta=0.1, peft_config=peft.LoraConfig(**lora), **F64
        )
        assert t.args.gradient_checkpointing and next(t.model.parameters()).dtype == torch.float64
        runs.append({n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_" in n})
    plain, ours = runs
    assert plain and set(plain) == set(ours)
    dp, do = torch.cat([v.flatten() for v in plain.values()]), torch.cat([ours[n].flatten() for n in plain])
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((do - dp).abs().max()) <= 1e-9 * scale


@pytest.mark.slow
def test_moe_aux_loss_equals_rloo_trainer_under_a_budget(tmp_path, monkeypatch):
    """Qwen3-MoE with router_aux_loss_coef 0.5: RLOO adds the load-balancing loss of each microbatch; ours computes it
    under a budget that splits groups (the policy passes ask for it). float32 (transformers' grouped experts refuse
    float64): the same parameters to 1e-5 of the update, the float32 rounding of the gradients."""
    tok = build_tokenizer()
    init, state = moe_model(tmp_path, tok, "qwen3_moe")
    plain = train_two_steps(*PLAIN, init, tok, tmp_path / "plain", beta=0.1)
    assert plain.aux_loss_enabled
    calls = _spy(monkeypatch)
    ours = train_two_steps(*OURS, init, tok, tmp_path / "sp", beta=0.1, sharedprefix_max_tokens=32)
    monkeypatch.undo()
    policy = [src for src, kw in calls if kw.get("aux_loss")]
    assert policy and all(sp.plan(src, 32).splits for src in policy)
    no_aux = train_two_steps(*PLAIN, init, tok, tmp_path / "no_aux", beta=0.1, router_aux_loss_coef=0.0)
    dp = _delta(plain, state)
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((_delta(no_aux, state) - dp).abs().max()) > 1e-3 * scale  # the aux loss moves the update
    err = float((_delta(ours, state) - dp).abs().max())
    assert err <= 1e-5 * scale, (err, scale)
    logged = lambda t: [h["aux_loss"] for h in t.state.log_history if "aux_loss" in h]  # noqa: E731
    assert logged(plain) and logged(ours) == pytest.approx(logged(plain), rel=1e-5)
