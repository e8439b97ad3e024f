"""SharedPrefixGRPOTrainer with an MoE load-balancing loss, against TRL's GRPOTrainer.

TRL adds ``router_aux_loss_coef * aux_loss`` for each of its microbatches whenever the config has the attribute
``output_router_logits`` (the tiny configs here have it False, as TRL's fixtures do) and the coefficient is not 0.
Both trainers run the same tiny local Qwen3-MoE and GPT-OSS, same seed and data, and must reach the same parameters
after two steps: float32, within 1e-5 of the largest update (the runs agree to float32 rounding of the gradients).
"""

import pytest
import torch

import sharedprefix as sp
from tests.helpers import call_source

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import MOE_MODELS, moe_model, train_two_steps  # noqa: E402


def _delta(trainer, init):
    return torch.cat([(p.detach().float() - init[n].float()).flatten() for n, p in trainer.model.named_parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
def test_moe_aux_loss_trains_as_grpo_trainer_with_and_without_a_budget(tmp_path, kind, monkeypatch):
    tok = build_tokenizer()
    init, state = moe_model(tmp_path, tok, kind)
    plain = train_two_steps(GRPOTrainer, GRPOConfig, init, tok, tmp_path / "plain", beta=0.1)
    assert plain.aux_loss_enabled
    ours = train_two_steps(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", beta=0.1)
    calls = []
    logprobs = sp.logprobs

    def spy(model, source, **kw):
        calls.append((call_source(source), kw))
        return logprobs(model, source, **kw)

    monkeypatch.setattr(sp, "logprobs", spy)
    budget = train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        init,
        tok,
        tmp_path / "budget",
        beta=0.1,
        sharedprefix_max_tokens=32,
        sharedprefix_prefix_activations="keep",
    )
    monkeypatch.undo()
    # the policy passes asked for the aux loss, and the budget split their groups (prompts cached, backward later)
    policy = [(src, kw) for src, kw in calls if kw.get("aux_loss")]
    assert policy and all(sp.plan(src, 32).splits for src, _ in policy)
    no_aux = train_two_steps(
        GRPOTrainer, GRPOConfig, init, tok, tmp_path / "no_aux", beta=0.1, router_aux_loss_coef=0.0
    )
    dp = _delta(plain, state)
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((_delta(no_aux, state) - dp).abs().max()) > 1e-3 * scale  # the aux loss changes the update
    for run in (ours, budget):
        err = float((_delta(run, state) - dp).abs().max())
        assert err <= 1e-5 * scale, (err, scale)
    # TRL logs the aux loss of each microbatch: ours reports the same values
    logged = lambda t: [h["aux_loss"] for h in t.state.log_history if "aux_loss" in h]  # noqa: E731
    assert logged(plain) and logged(ours) == pytest.approx(logged(plain), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
def test_moe_aux_loss_with_optimizer_steps_trains_as_grpo_trainer(tmp_path, kind, monkeypatch):
    """TRL's default with accumulation (steps_per_generation = gradient_accumulation_steps = 2, microbatches of 4
    rows drawn by TRL's shuffle from 2 groups of 4): the two micro-steps' policy passes run as one ``sp.plan_step``
    step carrying each microbatch's own load-balancing loss (the step caches its prompts' router logits), each prompt
    once per optimizer step; the parameters and every logged aux loss equal GRPOTrainer's (float32, 1e-5 as above),
    and fewer policy tokens than a call per microbatch."""
    tok = build_tokenizer()
    init, state = moe_model(tmp_path, tok, kind)
    split = dict(beta=0.1, per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2)
    plain = train_two_steps(GRPOTrainer, GRPOConfig, init, tok, tmp_path / "plain", **split)
    steps, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda model, mbs, **kw: steps.append(kw) or plan_step(model, mbs, **kw))
    ours = train_two_steps(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", **split)
    monkeypatch.undo()
    off = train_two_steps(
        SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "off", sharedprefix_step=False, **split
    )
    assert len(steps) == 2 and all(kw["aux_loss"] for kw in steps)  # a step per optimizer step, with the loss
    dp = _delta(plain, state)
    scale = float(dp.abs().max())
    assert scale > 1e-3
    err = float((_delta(ours, state) - dp).abs().max())
    assert err <= 1e-5 * scale, (err, scale)
    logged = lambda t, key: [h[key] for h in t.state.log_history if key in h]  # noqa: E731
    assert logged(plain, "aux_loss") and logged(ours, "aux_loss") == pytest.approx(logged(plain, "aux_loss"), rel=1e-5)
    tokens = lambda t: sum(logged(t, "sharedprefix/step_tokens_computed"))  # noqa: E731
    assert 0 < tokens(ours) < tokens(off), (tokens(ours), tokens(off))


@pytest.mark.slow
def test_rloo_moe_aux_loss_with_optimizer_steps_trains_as_rloo_trainer(tmp_path, monkeypatch):
    """The same for ``SharedPrefixRLOOTrainer`` (Qwen3-MoE): its steps carry the load-balancing loss, and the
    parameters equal RLOOTrainer's (float32, 1e-5 of the update), which the loss moves by far more than that."""
    from trl import RLOOConfig, RLOOTrainer

    from sharedprefix.integrations.trl import SharedPrefixRLOOConfig, SharedPrefixRLOOTrainer

    tok = build_tokenizer()
    init, state = moe_model(tmp_path, tok, "qwen3_moe")
    split = dict(beta=0.1, per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2)
    plain = train_two_steps(RLOOTrainer, RLOOConfig, init, tok, tmp_path / "plain", **split)
    assert plain.aux_loss_enabled
    steps, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda model, mbs, **kw: steps.append(kw) or plan_step(model, mbs, **kw))
    ours = train_two_steps(SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig, init, tok, tmp_path / "sp", **split)
    monkeypatch.undo()
    no_aux = train_two_steps(RLOOTrainer, RLOOConfig, init, tok, tmp_path / "no", router_aux_loss_coef=0.0, **split)
    assert len(steps) == 2 and all(kw["aux_loss"] for kw in steps)
    dp = _delta(plain, state)
    scale = float(dp.abs().max())
    assert float((_delta(no_aux, state) - dp).abs().max()) > 1e-3 * scale  # the aux loss changes the update
    err = float((_delta(ours, state) - dp).abs().max())
    assert err <= 1e-5 * scale, (err, scale)
