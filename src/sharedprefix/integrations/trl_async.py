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

The model's own attention is switched from TRL's ``tree_fa3`` to ``sdpa`` (``eager`` where the model has no sdpa):
nothing calls the model's forward with tree tensors any more, and sharedprefix's once-per-model head check runs the
model's own forward on a plain row. Refused when built, each with the setting that removes it: an MoE
load-balancing loss (TRL's is taken over the packed row's unique tokens, which no per-row computation reproduces),
FSDP (grad-enabled ``sp.logprobs`` is refused under FSDP2), fp16 loss scaling, ``neftune_noise_alpha``, what
``check_supported`` refuses in eval or in training mode (dropout: TRL trains in training mode), reentrant gradient
checkpointing with a ``sharedprefix_max_tokens`` budget (``trl_checks``), and ``sharedprefix_group_microbatches=True``
(nothing here forms or reorders microbatches: TRL's ``token_budget`` planner does, and the packed row is computed as
given). TRL's own ``AsyncGRPOConfig`` is accepted (``trl_settings.setting``).

Notation: N = packed tokens of a rank's row, R = its leaf rows (samples up to identical ones), L = longest row.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

import sharedprefix as sp
from sharedprefix.integrations.plan_cache import PlanCache, log_plan, plan_capacity
from sharedprefix.integrations.trl_async_layout import packed_tree, to_packed
from sharedprefix.integrations.trl_checks import check_neftune, check_reentrant_budget, check_training_noise
from sharedprefix.integrations.trl_settings import SharedPrefixSettings, checked_settings, setting
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
        if setting(self.args, "sharedprefix_group_microbatches"):
            raise ValueError(
                "sharedprefix_group_microbatches=True is a setting of SharedPrefixGRPOTrainer and "
                "SharedPrefixRLOOTrainer: SharedPrefixAsyncGRPOTrainer forms no microbatches (TRL's token_budget "
                "planner does, and this trainer computes the packed row it is given, its rows in TRL's order), so the "
                "setting would be ignored. Leave it False; to compute a group's prompt once, give token_budget room "
                "for a group's unique tokens and bound memory with sharedprefix_max_tokens (docs/trl.md)."
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
        # TRL reads the entropies for its metrics only
        entropy = None if out.entropy is None else to_packed(out.entropy.detach(), pt)
        return SimpleNamespace(log_probs=to_packed(out.logprobs, pt), entropy=entropy, aux_loss=None)
