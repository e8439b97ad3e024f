"""SharedPrefixGRPOTrainer plans each batch once: its old-policy and reference log-probs (the whole generation batch)
share one ``CallPlan``, and each policy microbatch is planned once for all of its PPO iterations."""

import pytest

import sharedprefix as sp

pytest.importorskip("trl")
pytest.importorskip("datasets")

from sharedprefix.integrations import plan_cache  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import qwen3_model, train_two_steps  # noqa: E402


def test_grpo_trainer_plans_once_per_batch(tmp_path, monkeypatch):
    plannings, calls = [], []
    planned = plan_cache.plan_unagreed
    logprobs = sp.logprobs

    def count_plan(model, source, given):
        plannings.append(len(source.rows))
        return planned(model, source, given)

    def count_call(model, source, **kw):
        calls.append(isinstance(source, sp.CallPlan))
        return logprobs(model, source, **kw)

    monkeypatch.setattr(plan_cache, "plan_unagreed", count_plan)
    monkeypatch.setattr(sp, "logprobs", count_call)
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    # one generation batch of 8 rows, 2 PPO iterations over it (2 optimizer steps): the old-policy and the
    # reference log-probs of the 8 rows, then the policy's on the (shuffled) microbatch, once per iteration
    train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        str(tmp_path / "init"),
        tok,
        tmp_path / "sp",
        beta=0.1,
        num_iterations=2,
    )
    assert calls == [True] * 4
    assert plannings == [8, 8]  # old + reference: one plan; the policy's microbatch: one plan for both iterations


def test_grpo_trainer_logs_what_sharedprefix_did(tmp_path):
    """Each step's log (TRL's own metrics, averaged over the step's calls) says what sharedprefix computed."""
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    trainer = train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        str(tmp_path / "init"),
        tok,
        tmp_path / "sp",
        sharedprefix_max_tokens=32,
        sharedprefix_prefix_activations="recompute",
    )
    logs = [h for h in trainer.state.log_history if "sharedprefix/tokens_computed" in h]
    assert len(logs) == 2  # one per step
    for h in logs:
        assert 0 < h["sharedprefix/tokens_computed"] < h["sharedprefix/tokens_plain"]  # prompts computed once
        assert h["sharedprefix/passes"] > 1  # the budget splits the batch
        assert h["sharedprefix/prefix_mode"] == 2.0  # "recompute"
        assert "sharedprefix/peak_memory_gib" not in h  # CPU: no device peak to report
