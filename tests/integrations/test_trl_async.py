"""SharedPrefixAsyncGRPOTrainer: TRL's AsyncGRPOTrainer with its packed rows computed by sharedprefix.

Fast: TRL's own packing (``TreeRow.pack`` of groups sharing their prompts) fed to our forward stand-in gives, on every
loss term ``compute_loss`` takes, the log-probs, entropies and parameter gradients of one plain forward per sample
(float64, 1e-9), also under a budget that splits a group. Slow: ``train()`` of ours against TRL's own trainer on CPU
(stub rollout worker and weight sync, a reference kernel in place of FA3, a float64 head in place of TRL's float32
one), with tree packing off and on, and under TRL's token-budget planner: the same parameters after two steps;
in float32 within twice TRL's own error. Optimizer steps (``sharedprefix_step``): with groups split over micro-steps,
the micro-steps of an optimizer step run as one step (each split prompt once), with the parameters of steps off and of
TRL's trainer; the step's checks raise rather than train on another gradient; the fallbacks.
"""

import contextlib
import types

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from helpers import assert_grads_close, tiny_model  # noqa: E402
from sharedprefix.integrations.plan_cache import PlanCache  # noqa: E402
from sharedprefix.integrations.trl_async import (  # noqa: E402
    PackedForward,
    SharedPrefixAsyncGRPOConfig,
    SharedPrefixAsyncGRPOTrainer,
)
from sharedprefix.integrations.trl_async_layout import packed_tree  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support import trl_async as stub  # noqa: E402

TEMPERATURE = 0.8


def _packed(samples):
    row = TreeRow()
    for s in samples:
        row.add({k: getattr(s, k) for k in ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id")})
    return row.pack()


def _call(forward, p):
    """``forward`` called as AsyncGRPOTrainer.compute_loss calls its model; returns (log-probs, entropies) of its
    loss terms (``token_index``)."""
    out = forward(
        input_ids=p["input_ids"][None],
        position_ids=p["position_ids"][None],
        shift_labels=p["shift_labels"][None],
        fused_lm_head=True,
        tree_kv_index=p["tree_kv_index"],
        tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
        tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
        tree_max_seqlen_k=int(p["tree_max_seqlens"][1]),
    )
    return out.log_probs.flatten()[p["token_index"]], out.entropy.flatten()[p["token_index"]]


def _plain(model, samples):
    """One plain forward per sample: (log-probs, entropies) of its completion tokens, in TRL's loss-term order."""
    lps, ents = [], []
    for s in samples:
        ids = torch.as_tensor(s.input_ids)
        logp = (model(input_ids=ids[None], use_cache=False).logits[0, :-1] / TEMPERATURE).log_softmax(-1)
        keep = torch.as_tensor(s.completion_mask[1:]).bool()
        lps.append(logp.gather(-1, ids[1:, None])[:, 0][keep])
        ents.append(-(logp.exp() * logp).sum(-1)[keep])
    return torch.cat(lps), torch.cat(ents)


def _trainer_stub(budget):
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext)
    return types.SimpleNamespace(
        temperature=TEMPERATURE, accelerator=accelerator, _sp_budget=budget, _sp_mode="keep", _sp_plans=PlanCache()
    )


def _grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    (lp * weights).sum().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), out


@pytest.mark.parametrize("budget", [12, pytest.param(None, marks=pytest.mark.slow)])
def test_trl_packing_through_sharedprefix_matches_plain_rows(budget):
    """Two groups of 4 (prompts of 10 tokens) packed by TRL into one tree row, one completion with a masked token
    inside it (a tool result), one sample twice (TRL shares it whole); budget 12 splits every group (its prompt
    cached, its completions in several passes). Plain: one sdpa forward per sample."""
    model = tiny_model("qwen3")
    samples = stub.rollouts(97, 2, 4, 10, (2, 5), seed=1)
    samples[1].completion_mask[-2] = 0
    samples.append(samples[5])
    p = _packed(samples)
    assert len(p["input_ids"]) < sum(len(s.input_ids) for s in samples) - 10  # both prompts shared
    w = torch.linspace(-1.0, 2.0, len(p["token_index"]), dtype=torch.float64)
    lp, ent, got = _grads(model, lambda: _call(PackedForward(_trainer_stub(budget), model), p), w)
    lp0, ent0, want = _grads(model, lambda: _plain(model, samples), w)
    assert lp.shape == lp0.shape and (lp - lp0).abs().max() <= 1e-9
    assert (ent - ent0).abs().max() <= 1e-9
    assert_grads_close(got, want, rtol=1e-9)


@pytest.mark.slow
def test_packed_tree_refuses_positions_that_are_not_depths():
    p = _packed(stub.rollouts(97, 1, 2, 4, (2, 3)))
    pos = p["position_ids"].clone()
    pos[-1] += 1
    with pytest.raises(ValueError, match="expected 0, 1, ... .each token's depth"):
        packed_tree(
            p["input_ids"][None], pos[None], p["shift_labels"][None], p["tree_kv_index"], p["tree_cu_seqlens_q"],
            p["tree_cu_seqlens_k"],
        )  # fmt: skip


# -- train(): ours against TRL's own AsyncGRPOTrainer ------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tokenizer, a tiny Qwen3 saved for every trainer, its float64 parameters, and 12 groups of 4 rollouts
    (prompts of 12 tokens, completions of 2 to 6): two steps of two microbatches of 8 use 8 groups (the dataloader
    fetches ahead)."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    path = stub.save_tiny_qwen3(tmp_path_factory.mktemp("init"), len(tok))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    return types.SimpleNamespace(
        tok=tok, path=path, init=init, samples=stub.rollouts(len(tok), 12, 4, 12, (2, 6)), out=tmp_path_factory
    )


def _deltas(trainer, init):
    return torch.cat([(p.detach().double() - init[n]).flatten() for n, p in trainer.model.named_parameters()])


def _run(setup, cls, cfg_cls, dtype=torch.float64, share=True, float64_head=True, **settings):
    """Parameter updates after ``cls`` trained 2 steps (``stub.build``); TRL's own trainer with its CPU stand-ins."""
    with pytest.MonkeyPatch.context() as m:
        if cls is AsyncGRPOTrainer:
            stub.patch_trl_kernels(m, float64_head=float64_head, share=share)
        trainer = stub.build(
            cls, cfg_cls, setup.path, setup.tok, setup.out.mktemp("run"), setup.samples, dtype, **settings
        )
        return _deltas(stub.train(trainer), setup.init)


@pytest.fixture(scope="module")
def trl_runs(setup):
    """TRL's own float64 updates, tree packing off (one chain per sample) and on."""
    return {share: _run(setup, AsyncGRPOTrainer, AsyncGRPOConfig, share=share) for share in (False, True)}


def _err(got, want):
    return float((got - want).abs().max()) / float(want.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget, mode, checkpointing",
    [(None, "keep", True), (10, "keep", True), (10, "recompute", True), (10, "offload", False)],
)
def test_same_parameters_as_async_grpo_trainer(setup, trl_runs, budget, mode, checkpointing):
    """float64, 2 SGD steps of 2 microbatches (2 groups of 4 each; some tokens clipped, the second step's gradient
    norm clipped): ours against TRL's trainer with tree packing off, and on. Budget 10 is below a prompt (12): every
    group's prompt is a chain of passes and its completions run in later passes. Measured: 1e-15 relative."""
    ours = _run(
        setup, SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, sharedprefix_max_tokens=budget,
        sharedprefix_prefix_activations=mode, gradient_checkpointing=checkpointing,
    )  # fmt: skip
    plain, tree = trl_runs[False], trl_runs[True]
    assert float(plain.abs().max()) > 1e-2  # the parameters moved
    assert _err(tree, plain) <= 1e-9  # TRL's two packings agree, so either is the reference
    assert _err(ours, plain) <= 1e-9
    assert _err(ours, tree) <= 1e-9


@pytest.mark.slow
def test_same_parameters_under_trl_token_budget(setup):
    """TRL's default planner (TokenBudgetBatcher, token_budget=26 unique tokens a microbatch): microbatches of 3
    samples and of 1, each group split between two (TRL computes its prompt in both, and so do we); ours (budget
    10) against TRL's trainer with tree packing on."""
    settings = dict(token_budget=26, per_device_train_batch_size=1)
    tree = _run(setup, AsyncGRPOTrainer, AsyncGRPOConfig, **settings)
    ours = _run(
        setup, SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, sharedprefix_max_tokens=10, **settings
    )
    assert float(tree.abs().max()) > 1e-2
    assert _err(ours, tree) <= 1e-9


@pytest.mark.slow
def test_float32_within_twice_trl_own_error(setup):
    """float32 with TRL's own float32 head: ours (budget 10, every group split) against TRL's float64 update is within
    twice TRL's own float32 run's error against it (the 2x rule). One step at a rate of 100 (the update clipped to
    norm 100), so that the update, not the float32 storage of the parameters, sets the error. Measured: TRL 4.2e-7,
    ours 4.0e-7."""
    step = dict(max_steps=1, learning_rate=100.0)
    want = _run(setup, AsyncGRPOTrainer, AsyncGRPOConfig, share=False, **step)
    trl32 = _run(setup, AsyncGRPOTrainer, AsyncGRPOConfig, dtype=torch.float32, float64_head=False, **step)
    ours32 = _run(
        setup, SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, dtype=torch.float32,
        sharedprefix_max_tokens=10, **step,
    )  # fmt: skip
    assert 0 < _err(trl32, want) < 1e-5  # float32 rounding, not a different computation
    assert _err(ours32, want) <= 2 * _err(trl32, want)


@pytest.mark.slow
def test_refusals(setup, tmp_path):
    """An MoE load-balancing loss (TRL's over the packed row's unique tokens), a bad budget, and whole groups per
    microbatch (a synchronous trainers' setting), refused when built."""
    import transformers as tf

    from sharedprefix.tools.zoo.configs import tiny_config

    cfg = tiny_config("qwen3_moe")
    cfg.vocab_size, cfg.router_aux_loss_coef = len(setup.tok), 0.5
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    build = lambda path, **kw: stub.build(  # noqa: E731
        SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, path, setup.tok, tmp_path / "out", [], **kw
    )
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.5.*Set router_aux_loss_coef=0.0"):
        build(str(tmp_path / "moe"))
    with pytest.raises(ValueError, match="sharedprefix_max_tokens=0; expected a positive int or None"):
        build(setup.path, sharedprefix_max_tokens=0)
    with pytest.raises(
        ValueError, match="sharedprefix_group_microbatches=True is a setting of SharedPrefixGRPOTrainer"
    ):
        build(setup.path, sharedprefix_group_microbatches=True)  # TRL forms the microbatches: it would be ignored


def test_dropout_and_reentrant_budget_refused_when_built(setup, tmp_path):
    """AsyncGRPOTrainer trains in training mode and has no disable_dropout: attention dropout is refused when built
    (before: at the first step, the model being in eval mode when built), naming the model's setting as the fix;
    reentrant checkpointing with a budget that can split a group too (before: at the first step that split one)."""
    build = lambda **kw: stub.build(  # noqa: E731
        SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, setup.path, setup.tok, tmp_path / "out", [], **kw
    )
    init = {"dtype": torch.float64, "use_kernels": False}
    with pytest.raises(
        ValueError,
        match=r"in training mode with attention_dropout=0.1.* AsyncGRPOTrainer trains the model in training mode and "
        r"has no disable_dropout setting.*model_init_kwargs=\{'attention_dropout': 0.0\}",
    ):
        build(model_init_kwargs={**init, "attention_dropout": 0.1})
    with pytest.raises(
        ValueError,
        match=r"gradient_checkpointing_kwargs=\{'use_reentrant': True\} \(reentrant\) and sharedprefix_max_tokens=10: "
        r".*so AsyncGRPOTrainer with these settings is refused when built",
    ):
        build(sharedprefix_max_tokens=10, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert build(sharedprefix_max_tokens=10).model.config.attention_dropout == 0.0


# -- optimizer steps: an optimizer step's micro-steps as one sp.plan_step step -------------------------------------

STEP_CASES = {
    "ga2": dict(gradient_accumulation_steps=2),
    "ga4-budget10-recompute": dict(
        gradient_accumulation_steps=4, sharedprefix_max_tokens=10, sharedprefix_prefix_activations="recompute"
    ),
    "ga4-graph": dict(gradient_accumulation_steps=4, gradient_checkpointing=False),
}
SPLIT = dict(per_device_train_batch_size=3)  # groups of 4 over microbatches of 3: every group split across two


@pytest.fixture(scope="module")
def trl_split_runs(setup):
    """TRL's own float64 updates with groups split across micro-steps, per gradient_accumulation_steps, tree packing
    off and on."""
    return {
        (ga, share): _run(
            setup, AsyncGRPOTrainer, AsyncGRPOConfig, share=share, gradient_accumulation_steps=ga, **SPLIT
        )
        for ga in (2, 4)
        for share in (False, True)
    }


def _spied_run(setup, monkeypatch, **settings):
    """Our update, the kinds of source of the grad-enabled sp.logprobs calls, and the logged per-optimizer-step
    tokens [(computed, plain)]."""
    import sharedprefix as sp

    calls, logprobs = [], sp.logprobs

    def spy(model, source, **kw):
        if torch.is_grad_enabled():
            calls.append(type(source).__name__)
        return logprobs(model, source, **kw)

    monkeypatch.setattr(sp, "logprobs", spy)
    trainer = stub.train(
        stub.build(
            SharedPrefixAsyncGRPOTrainer, SharedPrefixAsyncGRPOConfig, setup.path, setup.tok, setup.out.mktemp("run"),
            setup.samples, **settings,
        )
    )  # fmt: skip
    monkeypatch.setattr(sp, "logprobs", logprobs)
    logged = [
        (h["sharedprefix/step_tokens_computed"], h["sharedprefix/step_tokens_plain"])
        for h in trainer.state.log_history
        if "loss" in h
    ]
    return _deltas(trainer, setup.init), calls, logged


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_optimizer_step_runs_as_one_step(setup, trl_split_runs, monkeypatch, case):
    """float64, 2 optimizer steps of 2 or 4 micro-steps, groups of 4 over microbatches of 3 (each group's prompt in two
    micro-steps): with steps on (the default) every policy call is a step's microbatch, each prompt is computed once
    per optimizer step (fewer tokens than with steps off, the same plain tokens), and the parameters equal ours with
    steps off and TRL's trainer's, packing off and on, to 1e-9 of the update."""
    settings = {**SPLIT, **STEP_CASES[case]}
    ga = settings["gradient_accumulation_steps"]
    on, calls_on, tokens_on = _spied_run(setup, monkeypatch, **settings)
    off, calls_off, tokens_off = _spied_run(setup, monkeypatch, sharedprefix_step=False, **settings)
    assert calls_on and set(calls_on) == {"Microbatch"}, calls_on
    assert calls_off and "Microbatch" not in calls_off, calls_off
    assert len(tokens_on) == len(tokens_off) == 2  # one entry per optimizer step
    for (computed, plain), (computed_off, plain_off) in zip(tokens_on, tokens_off):
        assert plain == plain_off
        assert computed <= computed_off - 12 * (ga - 1)  # a 12-token prompt once, not in each of ga micro-steps
    plain_trl, tree_trl = trl_split_runs[(ga, False)], trl_split_runs[(ga, True)]
    assert float(plain_trl.abs().max()) > 1e-2
    assert _err(tree_trl, plain_trl) <= 1e-9
    for want in (off, plain_trl, tree_trl):
        assert _err(on, want) <= 1e-9


class _Misfed(SharedPrefixAsyncGRPOTrainer):
    """Runs micro-step 0 on micro-step 1's batch: other rows than its step planned for it."""

    def training_step(self, model, inputs, num_items_in_batch):
        return super().training_step(model, self._sp_batches[1] if self._sp_t == 0 else inputs, num_items_in_batch)


class _EarlySync(SharedPrefixAsyncGRPOTrainer):
    """Synchronises gradients at micro-step 0, inside its optimizer step."""

    def training_step(self, model, inputs, num_items_in_batch):
        if self._sp_t == 0:
            self.accelerator.gradient_state._set_sync_gradients(True)
        return super().training_step(model, inputs, num_items_in_batch)


class _DetachedLoss(SharedPrefixAsyncGRPOTrainer):
    """A loss that does not backpropagate through the log-probs (their microbatches' backward never runs)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss.detach() + 0.0 * next(model.parameters()).sum()


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, match",
    [
        (_Misfed, r"the policy log-prob hook got rows \(.*\) other than those of micro-step 0's microbatch"),
        (_EarlySync, r"micro-step 0 runs with accelerator.sync_gradients=True, but the optimizer step it belongs to "
         r"ends at micro-step 1"),
        (_DetachedLoss, r"the step over micro-steps \[0, 1\] did not finish at its last micro-step"),
    ],
)  # fmt: skip
def test_step_checks_raise_rather_than_train_on_another_gradient(setup, tmp_path, cls, match):
    """The checks around a step's micro-steps (shared with the synchronous trainers, ``trl_step``): the hook's rows
    are the planned microbatch's, the accumulation boundary is where the step was planned, the step finished."""
    trainer = stub.build(
        cls, SharedPrefixAsyncGRPOConfig, setup.path, setup.tok, tmp_path, setup.samples, max_steps=1, **SPLIT
    )
    with pytest.raises(RuntimeError, match=match):
        stub.train(trainer)


@pytest.mark.slow
def test_steps_fall_back_with_their_reason(setup, tmp_path, monkeypatch, caplog):
    """Reentrant gradient checkpointing (a step's cached prompts would get no gradient) runs each micro-step on its
    own, saying why once; a single micro-step per optimizer step plans no step; TRL's own AsyncGRPOConfig plans
    steps (the default)."""
    import logging

    import sharedprefix as sp

    planned, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda *a, **kw: planned.append(1) or plan_step(*a, **kw))
    build = lambda cfg_cls, **kw: stub.build(  # noqa: E731
        SharedPrefixAsyncGRPOTrainer, cfg_cls, setup.path, setup.tok, tmp_path / str(len(planned)), setup.samples,
        max_steps=1, **SPLIT, **kw,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sharedprefix.integrations.trl_step"):
        stub.train(build(SharedPrefixAsyncGRPOConfig, gradient_checkpointing_kwargs={"use_reentrant": True}))
    assert planned == []
    assert [r for r in caplog.records if "use_reentrant=True" in r.getMessage()], caplog.records
    stub.train(build(SharedPrefixAsyncGRPOConfig, gradient_accumulation_steps=1))
    assert planned == []
    stub.train(build(AsyncGRPOConfig))
    assert planned == [1]
