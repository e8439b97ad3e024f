"""``SharedPrefixAsyncGRPOTrainer``: TRL's asynchronous ``AsyncGRPOTrainer`` with its packed rows' log-probs and
gradients computed by sharedprefix, exactly, on any device.

TRL's trainer already shares prefixes: it folds a rank's samples into a prefix trie, one packed row, and runs it
through a tree attention that needs the FA3 varlen kernel (Hopper only), within one microbatch. Here the one hook
``compute_loss`` is overridden, and only to hand TRL's own ``compute_loss`` (its loss, clipping, normalisation and
metrics, unchanged) a stand-in for the model: called with the packed row and its tree index tensors, it turns them
into a ``sharedprefix.Tree`` (``trl_async_layout``) and returns ``sp.logprobs``' log-probs and entropies on the
packed positions, where TRL's fused head would put them. With ``sharedprefix_max_tokens`` set (or gradient
checkpointing on, TRL's default) the values are deferred (``sp.logprobs(defer=True)``): TRL's backward of its loss
runs ``sp.backward`` under the budget with the per-token gradients, so a group larger than the budget computes its
prompt once and its completions in several passes, exactly.

Optimizer steps (``sharedprefix_step``, the default; ``integrations.trl_step``): TRL 1.16's async trainer has no
generation batch and no ``num_iterations``; its planner (``TokenBudgetBatcher`` or ``FixedCountBatcher``) yields one
micro-batch of fresh samples at a time (a group split over two when it does not fit), transformers'
``_inner_training_loop`` fetches an optimizer step's ``gradient_accumulation_steps`` of them with
``get_batch_samples`` before the first runs, and the parameters change only at ``optimizer.step()`` after the last
(the weight sync to vLLM copies them out). So an optimizer step's micro-steps are one window: ``get_batch_samples`` is
overridden to keep the fetched batches, and ``training_step`` plans them as one ``sp.plan_step`` step at the first
micro-step, each batch's packed row read as ``compute_loss`` reads it (``trl_async_layout.packed_inputs``); each
micro-step's stand-in call is ``sp.logprobs(model, step.microbatch(k))``, so a prompt whose samples fall in two
micro-steps of one optimizer step is computed once. The checks and the fallback are the synchronous trainers'.

The model's own attention is switched from TRL's ``tree_fa3`` to ``sdpa`` (``eager`` where the model has no sdpa):
nothing calls the model's forward with tree tensors any more, and sharedprefix's once-per-model head check runs the
model's own forward on a plain row. Refused when built, each with the setting that removes it: an MoE
load-balancing loss (TRL's is taken over the packed row's unique tokens, which no per-row computation reproduces),
FSDP (grad-enabled ``sp.logprobs`` is refused under FSDP2), fp16 loss scaling, ``neftune_noise_alpha``, what
``check_supported`` refuses in eval or in training mode (dropout: TRL trains in training mode), reentrant gradient
checkpointing with a ``sharedprefix_max_tokens`` budget (``trl_checks``), and ``sharedprefix_group_microbatches=True``
(nothing here forms or reorders microbatches: TRL's ``token_budget`` planner does, and each packed row is computed
as given). TRL's own ``AsyncGRPOConfig`` is accepted (``trl_settings.setting``).

Notation: N = packed tokens of a rank's row, R = its leaf rows (samples up to identical ones), L = longest row.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

import sharedprefix as sp
from sharedprefix.integrations.plan_cache import PlanCache, log_plan, plan_capacity
from sharedprefix.integrations.trl_async_layout import packed_inputs, packed_tree, to_packed
from sharedprefix.integrations.trl_checks import check_neftune, check_reentrant_budget, check_training_noise
from sharedprefix.integrations.trl_settings import SharedPrefixSettings, checked_settings, setting
from sharedprefix.integrations.trl_step import (
    StepState,
    Window,
    add_tokens,
    begin_update,
    enter_micro_step,
    make_window,
    run_micro_step,
    step_logprobs,
)
from sharedprefix.model.adapter import unwrap

__all__ = ["PackedForward", "SharedPrefixAsyncGRPOConfig", "SharedPrefixAsyncGRPOTrainer"]


@dataclass
class SharedPrefixAsyncGRPOConfig(AsyncGRPOConfig, SharedPrefixSettings):
    """``AsyncGRPOConfig`` plus the settings of sharedprefix (``SharedPrefixSettings``). TRL's ``token_budget`` still
    decides which samples form a microbatch; with ``sharedprefix_max_tokens`` bounding a pass, it can be large enough
    to hold whole groups."""


class SharedPrefixAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose packed rows are computed by sharedprefix; same constructor, same loss."""

    def __init__(self, *args, **kwargs):
        with _without_cuda_peak_flops():
            super().__init__(*args, **kwargs)
        self._sp_budget, self._sp_mode = checked_settings(self)
        self._sp_plans = PlanCache(capacity=plan_capacity(self))
        self._sp_step = StepState()
        self._sp_t = 0  # micro-steps trained so far (TRL's async trainer counts none)
        self._sp_batches: list[dict] = []  # the batches of the optimizer step under way, as transformers fetched them
        if setting(self.args, "sharedprefix_group_microbatches"):
            raise ValueError(
                "sharedprefix_group_microbatches=True is a setting of SharedPrefixGRPOTrainer and "
                "SharedPrefixRLOOTrainer: SharedPrefixAsyncGRPOTrainer forms no microbatches (TRL's token_budget "
                "planner does, and this trainer computes the packed row it is given, its rows in TRL's order), so the "
                "setting would be ignored. Leave it False: with sharedprefix_step=True (the default) a group's prompt "
                "is computed once per optimizer step whichever of its micro-steps its samples fall in (docs/trl.md)."
            )
        inner = unwrap(self.model)
        if getattr(self, "is_fsdp_enabled", False):
            raise ValueError(
                "FSDP is enabled (accelerate's fsdp_plugin): SharedPrefixAsyncGRPOTrainer computes TRL's log-probs "
                "with sp.logprobs inside compute_loss, whose backward would run outside FSDP2's hooks, so sharedprefix "
                "refuses it. Train without FSDP (one process or DDP), or call sp.backward in your own loop "
                "(docs/distributed.md)."
            )
        if self.aux_loss_enabled:
            raise ValueError(
                f"{type(inner).__name__} is an MoE model with a load-balancing loss (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}): AsyncGRPOTrainer takes that loss over the packed row's unique tokens, "
                "each shared prompt token once, which sharedprefix (whose aux loss is the plain per-row one) does not "
                "reproduce. Set router_aux_loss_coef=0.0 in the config (routing itself stays exact)."
            )
        check_neftune(self)
        check_training_noise(self, inner, hybrid=False)  # check_supported in eval and in training mode, as trained
        check_reentrant_budget(self, self._sp_budget)
        # nothing calls the forward with TRL's tree tensors any more; the head check runs it on a plain row
        inner.set_attn_implementation("sdpa" if inner._supports_sdpa else "eager")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(PackedForward(self, model), inputs, return_outputs, num_items_in_batch)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' fetch of one optimizer step's batches (one per micro-step), before the first of them runs:
        kept, so that the step's micro-steps can be planned as one ``sp.plan_step`` step; the next micro-step starts
        the optimizer step."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._sp_batches = list(batches)
        begin_update(self, self._sp_t)
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's micro-step; its optimizer step's micro-steps are one window (``trl_step.enter_micro_step``, planned
        at the first from the fetched batches), checked and logged by ``trl_step.run_micro_step``."""
        t, start = self._sp_t, self._sp_step.update_start
        micro = range(start, start + len(self._sp_batches)) if start is not None else range(t, t + 1)
        if t not in micro:  # a micro-step transformers did not fetch with an optimizer step: on its own
            micro = range(t, t + 1)
        model.train()  # as transformers' training_step does first: the step is planned, and checked, as trained
        enter_micro_step(self, model, t, micro, micro[-1], lambda: self._plan_window(model, micro))
        self._sp_t += 1
        return run_micro_step(self, t, partial(super().training_step, model, inputs, num_items_in_batch))

    def _plan_window(self, model, micro: range) -> Window:
        """The step of the optimizer step's micro-steps ``micro`` on ``model``: each fetched batch's packed row, as
        ``compute_loss`` will pass it, as a tree (``trl_async_layout``)."""
        inputs = [packed_inputs(b) for b in self._sp_batches]
        rows = [packed_tree(*x) for x in inputs]
        return make_window(self, model, micro, inputs, rows, [r.tree for r in rows])


@contextmanager
def _without_cuda_peak_flops():
    """Without CUDA, AsyncGRPOTrainer.__init__ fails where it reads the CUDA device name for its MFU metric
    (``get_peak_flops_per_device``); there, for the constructor's duration, the peak is unknown (None), which TRL
    itself answers by logging no MFU. With CUDA nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    saved = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = saved


class PackedForward:
    """What ``AsyncGRPOTrainer.compute_loss`` calls as its model: the packed row in, per-position log-probs and
    entropies out (``FusedCausalLMOutput``'s fields that it reads), computed by sharedprefix."""

    def __init__(self, trainer: SharedPrefixAsyncGRPOTrainer, model: torch.nn.Module):
        self.trainer, self.model = trainer, model

    def __call__(
        self,
        input_ids,
        position_ids,
        shift_labels,
        tree_kv_index,
        tree_cu_seqlens_q,
        tree_cu_seqlens_k,
        tree_max_seqlen_q=None,
        tree_max_seqlen_k=None,
        fused_lm_head=True,
        **extra,
    ):
        if not fused_lm_head or extra:
            raise ValueError(
                f"AsyncGRPOTrainer.compute_loss called its model with fused_lm_head={fused_lm_head} and "
                f"{sorted(extra)}; SharedPrefixAsyncGRPOTrainer takes the packed row TRL 1.16 passes (input_ids, "
                "position_ids, shift_labels, tree tensors, fused_lm_head=True). Use the trl version pinned in "
                "sharedprefix's extra."
            )
        t = self.trainer
        tensors = (input_ids, position_ids, shift_labels, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k)
        state = getattr(t, "_sp_step", None)  # None on a stand-in that has only what the hook reads
        if torch.is_grad_enabled() and state is not None and state.current is not None:
            out, pt = step_logprobs(t, self.model, tensors, entropy=True)  # its microbatch of the optimizer step
        else:
            out, pt = self._call(tensors, policy=torch.is_grad_enabled() and state is not None)
        # TRL reads the entropies for its metrics only
        entropy = None if out.entropy is None else to_packed(out.entropy.detach(), pt)
        return SimpleNamespace(log_probs=to_packed(out.logprobs, pt), entropy=entropy, aux_loss=None)

    def _call(self, tensors, policy: bool):
        """The packed row as a call of its own (each prompt once in it); ``policy``: a training micro-step's pass,
        whose tokens count in its optimizer step's (``trl_step.add_tokens``)."""
        t = self.trainer
        source, pt = t._sp_plans.lookup(  # planned once per packed row, whatever the calls on it
            self.model, tensors, (), lambda: ((p := packed_tree(*tensors)).tree, p), max_tokens=t._sp_budget
        )
        defer = True if (torch.is_grad_enabled() and t._sp_budget is not None) else None
        with t.accelerator.autocast():  # as TRL's own forward
            out = sp.logprobs(
                self.model,
                source,
                temperature=t.temperature,
                entropy=True,
                max_tokens=t._sp_budget,
                defer=defer,
                prefix_activations=t._sp_mode,
                grad_reduction="mean",  # TRL scales its loss for DDP's average over ranks
                aux_loss=False,  # refused at construction
            )
        log_plan(t, source, "train" if self.model.training else "eval")  # into TRL's own metrics
        if policy and isinstance(source, sp.CallPlan):
            add_tokens(t, source.plan.tokens_computed, source.plan.plain_tokens)
        return out, pt
