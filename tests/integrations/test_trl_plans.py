"""The TRL trainers plan each batch once: the old-policy and reference log-probs (the whole generation batch) share
one ``CallPlan`` (with a PEFT policy, the reference is the same model with its adapter disabled), each policy
microbatch is planned once for all of its PPO iterations, and the asynchronous trainer plans each packed row once.
Each step's log carries what sharedprefix computed (``sharedprefix/*`` in TRL's own metrics)."""

import types

import pytest
import torch

import sharedprefix as sp

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations import plan_cache  # noqa: E402
from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.integrations.trl_async import SharedPrefixAsyncGRPOConfig, SharedPrefixAsyncGRPOTrainer  # noqa: E402
from sharedprefix.model.adapter import adapter_state  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support import trl_async as stub  # noqa: E402
from support.grpo import float64_qwen3_norms, plain_rows, qwen3_model, train_two_steps  # noqa: E402

GRPO, RLOO = (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig), (SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig)


def _count(monkeypatch):
    """(plannings, calls): the rows of each plan the trainers' ``PlanCache`` makes, and for each ``sp.logprobs`` call
    whether it got a ``CallPlan`` and whether some PEFT adapter of its model was disabled."""
    plannings, calls = [], []
    planned, logprobs = plan_cache.plan_unagreed, sp.logprobs

    def count_plan(model, source, given):
        plannings.append(len(source.rows))
        return planned(model, source, given)

    def count_call(model, source, **kw):
        disabled = any(off for _, off, _ in adapter_state(model))
        calls.append(types.SimpleNamespace(planned=isinstance(source, sp.CallPlan), disabled=disabled))
        return logprobs(model, source, **kw)

    monkeypatch.setattr(plan_cache, "plan_unagreed", count_plan)
    monkeypatch.setattr(sp, "logprobs", count_call)
    return plannings, calls


def _saved(tmp_path, model):
    model.save_pretrained(tmp_path / "init")
    return str(tmp_path / "init")


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_synchronous_trainers_plan_once_per_batch(tmp_path, monkeypatch, trainer):
    plannings, calls = _count(monkeypatch)
    tok = build_tokenizer()
    init = _saved(tmp_path, qwen3_model(tok))
    # one generation batch of 8 rows, 2 PPO iterations over it (2 optimizer steps): the old-policy and the
    # reference log-probs of the 8 rows, then the policy's on the (shuffled) microbatch, once per iteration
    train_two_steps(*(GRPO if trainer == "grpo" else RLOO), init, tok, tmp_path / "sp", beta=0.1, num_iterations=2)
    assert [c.planned for c in calls] == [True] * 4
    assert plannings == [8, 8]  # old + reference: one plan; the policy's microbatch: one plan for both iterations


def test_grpo_plans_once_per_batch_over_several_microbatches(tmp_path, monkeypatch):
    """steps_per_generation=2, num_iterations=2, gradient_accumulation_steps=2, 2 optimizer steps = 4 micro-steps.
    TRL generates every steps_per_generation * num_iterations = 4 micro-steps a generation batch of
    per_device_train_batch_size * steps_per_generation = 16 rows, computes its old-policy log-probs (as
    gradient_accumulation_steps % 4 != 0) and reference log-probs over all 16 in one call each, then splits it into 2
    microbatches of 8 trained at micro-steps 0, 1 (iteration 1) and again at 2, 3 (iteration 2). Each microbatch on
    its own (``sharedprefix_step=False``): 2 + 4 calls, 3 plans (the 16 rows; each microbatch once). As steps (the
    default): the 16 rows planned once for the no-grad calls, and each optimizer step (micro-steps 0, 1 and 2, 3) one
    ``sp.plan_step`` of its 2 microbatches, whose calls take the step's microbatches."""
    settings = dict(beta=0.1, num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=2)
    tok = build_tokenizer()
    init = _saved(tmp_path, qwen3_model(tok))
    plannings, calls = _count(monkeypatch)
    trainer = train_two_steps(*GRPO, init, tok, tmp_path / "sp", sharedprefix_step=False, **settings)
    assert trainer.state.global_step == 2 and trainer._step == 4
    assert [c.planned for c in calls] == [True] * 6
    assert plannings == [16, 8, 8]
    monkeypatch.undo()
    plannings, calls = _count(monkeypatch)
    steps, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda m, mbs, **kw: steps.append(len(mbs)) or plan_step(m, mbs, **kw))
    train_two_steps(*GRPO, init, tok, tmp_path / "steps", **settings)
    assert [c.planned for c in calls] == [True] * 2 + [False] * 4 and plannings == [16] and steps == [2, 2]


def test_async_trainer_plans_each_packed_row_once(tmp_path, monkeypatch):
    """AsyncGRPOTrainer has no old-policy or reference pass (the rollout worker's log-probs are the old ones): each
    micro-step computes one packed row of 8 samples (2 groups of 4). 2 optimizer steps of 2 micro-steps: with steps
    off, 4 calls, 4 plans; with steps (the default), one plan per optimizer step of its 2 packed rows, its micro-steps
    called on the step's microbatches; each step's log says what sharedprefix computed."""
    plannings, calls = _count(monkeypatch)
    tok = build_tokenizer()
    path = stub.save_tiny_qwen3(tmp_path / "init", len(tok))
    samples = stub.rollouts(len(tok), 12, 4, 12, (2, 6))  # prompts of 12 tokens, completions of 2 to 6
    cls = (SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig)
    settings = dict(sharedprefix_max_tokens=10, sharedprefix_prefix_activations="recompute")
    off = dict(settings, sharedprefix_step=False)
    trainer = stub.train(stub.build(*cls, path, tok, tmp_path / "off", samples, torch.float32, **off))
    assert [c.planned for c in calls] == [True] * 4
    assert plannings == [8] * 4
    _assert_logged(trainer, passes_above=1)
    del calls[:], plannings[:]
    steps, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda m, mbs, **kw: steps.append(len(mbs)) or plan_step(m, mbs, **kw))
    trainer = stub.train(stub.build(*cls, path, tok, tmp_path / "on", samples, torch.float32, **settings))
    assert [c.planned for c in calls] == [False] * 4 and plannings == [] and steps == [2, 2]
    _assert_logged(trainer, passes_above=1)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_synchronous_trainers_log_what_sharedprefix_did(tmp_path, trainer):
    """Each step's log (TRL's own metrics, averaged over the step's calls) says what sharedprefix computed."""
    tok = build_tokenizer()
    init = _saved(tmp_path, qwen3_model(tok))
    cls = GRPO if trainer == "grpo" else RLOO
    settings = dict(sharedprefix_max_tokens=32, sharedprefix_prefix_activations="recompute")
    _assert_logged(train_two_steps(*cls, init, tok, tmp_path / "sp", **settings), passes_above=1)


def _assert_logged(trainer, passes_above):
    logs = [h for h in trainer.state.log_history if "sharedprefix/tokens_computed" in h]
    assert len(logs) == 2  # one per step
    for h in logs:
        assert 0 < h["sharedprefix/tokens_computed"] < h["sharedprefix/tokens_plain"]  # prompts computed once
        assert h["sharedprefix/passes"] > passes_above  # the budget splits the batch
        assert h["sharedprefix/prefix_mode"] == 2.0  # "recompute"
        assert "sharedprefix/peak_memory_gib" not in h  # CPU: no device peak to report


def test_grpo_with_a_peft_adapter_plans_once_and_trains_as_grpo_trainer(tmp_path, monkeypatch):
    """A LoRA policy (init_lora_weights=False: the adapter changes the log-probs from the first step) with beta 0.1:
    TRL takes the reference log-probs from the policy with its adapter disabled, which reuses the old-policy call's
    plan. float64: the adapters' update equals the exact run's (GRPOTrainer with a plain per-row forward) to a
    relative 1e-9, and GRPOTrainer's own (float32 head) to 1e-5 (measured: 1.7e-15 and 3.6e-7)."""
    peft = pytest.importorskip("peft")
    float64_qwen3_norms(monkeypatch)
    tok = build_tokenizer()
    init = _saved(tmp_path, qwen3_model(tok))
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    settings = dict(beta=0.1, num_iterations=2, model_init_kwargs={"dtype": torch.float64})

    def run(cls, cfg_cls, name):
        t = train_two_steps(cls, cfg_cls, init, tok, tmp_path / name, peft_config=peft.LoraConfig(**lora), **settings)
        assert next(t.model.parameters()).dtype == torch.float64
        return {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_" in n}

    exact = run(plain_rows(GRPOTrainer), GRPOConfig, "exact")
    plain = run(GRPOTrainer, GRPOConfig, "plain")
    with pytest.MonkeyPatch.context() as counting:
        plannings, calls = _count(counting)
        ours = run(*GRPO, "sp")
    # old policy (adapter on), reference (adapter off), the policy's microbatch twice (adapter on): two plans
    assert [(c.planned, c.disabled) for c in calls] == [(True, False), (True, True), (True, False), (True, False)]
    assert plannings == [8, 8]
    assert exact and set(exact) == set(ours) == set(plain)
    de, do, dp = (torch.cat([d[n].flatten() for n in sorted(exact)]) for d in (exact, ours, plain))
    initial = _lora_init(peft, init, lora)
    scale = float((de - initial).abs().max())
    assert scale > 1e-3  # the adapters moved
    assert float((do - de).abs().max()) <= 1e-9 * scale
    assert float((do - dp).abs().max()) <= 1e-5 * scale


def _lora_init(peft, init, lora):
    """The adapters' initial values, flattened in name order (seed 0, as TRL's runs draw them)."""
    import transformers as tf

    torch.manual_seed(0)
    m = peft.get_peft_model(tf.AutoModelForCausalLM.from_pretrained(init, dtype=torch.float64), peft.LoraConfig(**lora))
    state = {n: p.detach() for n, p in m.named_parameters() if "lora_" in n}
    return torch.cat([state[n].flatten() for n in sorted(state)])
