"""``SharedPrefixGRPOTrainer`` and ``SharedPrefixRLOOTrainer``: TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with every
log-prob computed by sharedprefix.

Only the log-prob hook, ``_prepare_inputs`` and ``training_step`` are overridden (``SharedPrefixHooks``, mixed into
both: the two TRL trainers share the hook's signature and the body of ``_prepare_inputs``), so TRL's own loss code
(every ``loss_type``, RLOO's sequence-level ratio, clipping, KL, entropy bonus, masks, metrics) runs unchanged. By
default (``sharedprefix_step``) the policy passes of an optimizer step's micro-steps from one generation batch run as
one ``sp.plan_step`` step, each prompt once per optimizer step (``integrations.trl_step``: the window, its checks and
when it falls back); otherwise:

- ``_get_per_token_logps_and_entropies`` turns the rows ``[left-padded prompt | completion]`` into a
  ``sharedprefix.Tree`` (a token trie: a system prompt common to every prompt of the microbatch is
  one segment, each prompt another, each completion a leaf; completion tokens trained) and
  computes old-policy, reference and policy log-probs with every shared prefix once.
  With ``sharedprefix_max_tokens`` set (or gradient checkpointing on), the policy pass is
  deferred (``sp.logprobs(defer=True)``): the forward runs without a graph, and when TRL
  backpropagates its loss, the incoming per-token gradients dL/dlogp (and dL/dentropy) drive
  ``sp.backward`` under the budget with the linear loss ``sum(dL/dlogp * logp)``, whose
  parameter gradient is exactly dL/dtheta (chain rule). Under FSDP2, which refuses a grad-enabled ``sp.logprobs``,
  the policy pass computes its values without grad and hands TRL leaves; its backward runs after TRL's, as
  ``sp.backward`` driven by the leaves' gradients (``integrations.trl_after``).
- ``_prepare_inputs`` is TRL's own by default: each microbatch holds the rows TRL's shuffle gives it (rows of one
  prompt may fall in different microbatches; those in the same one still share their prompt through the tree), so
  training follows ``GRPOTrainer``'s and ``RLOOTrainer``'s to rounding for every setting. The old-policy and
  reference log-probs are computed by TRL over the whole (local) generation batch before its shuffle, in one call
  of the hook (whose ``batch_size`` chunking is replaced by ``sharedprefix_max_tokens``), so those no-grad passes
  compute each prompt once whatever the microbatches. ``sharedprefix_group_microbatches=True`` keeps whole groups
  inside one microbatch instead (``_group_preserving_shuffle``: the same random draw as TRL, groups ordered by
  it): the same distribution of rows in another order, fewer prompt recomputations in the policy pass, but not
  TRL's parameters where microbatch membership matters (``membership_matters``), which it warns about.

Images (Qwen-style ``pixel_values`` with ``image_grid_thw``, or Llava-style ``pixel_values`` per image; see
``trl_batch``): the rows are regrouped by prompt and image into ``sp.Group``s with ``prompt_inputs``, so each
vision tower and prompt run once. Hybrid models (``schedule.cache_path``, which takes groups, not trees): the rows
are regrouped by prompt the same way.

What TRL's loss asks of the hook, as GRPOTrainer and RLOOTrainer compute it: the MoE load-balancing loss of the
microbatch's rows (``compute_aux_loss``: ``sp.logprobs(aux_loss=True)``, exact under a budget, see ``model.router``);
rows whose completion is all masked stay in the tree with nothing trained, so an all-masked microbatch gives a zero
loss with a graph; entropies keep a graph only when a loss uses them (GRPO's entropy bonus; RLOO logs them only);
``cast_lm_head_to_fp32`` (GRPO) runs the head in float32 outside autocast. What cannot be computed exactly is
refused when the trainer is built.

Notation: B = rows of a microbatch, C = completion columns (``logits_to_keep``), N = non-empty rows,
L = longest [prompt + completion] row.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

import sharedprefix as sp
from sharedprefix.integrations.plan_cache import PlanCache, log_plan, plan_capacity
from sharedprefix.integrations.trl_after import backward_pending, hold, refusal_of
from sharedprefix.integrations.trl_batch import (
    MULTIMODAL,
    TreeRows,
    check_image_inputs,
    from_groups,
    image_groups,
    to_rows,
    tree_rows,
)
from sharedprefix.integrations.trl_checks import (
    check_fsdp,
    check_neftune,
    check_reentrant_budget,
    check_training_noise,
    warn_if_padding_moves_logits,
)
from sharedprefix.integrations.trl_settings import SharedPrefixSettings, checked_settings, setting
from sharedprefix.integrations.trl_step import (
    StepState,
    add_tokens,
    begin_update,
    enter_micro_step,
    plan_window,
    run_micro_step,
    step_logprobs,
    window_of,
)
from sharedprefix.model import router
from sharedprefix.model.adapter import mark_float32_head, unwrap
from sharedprefix.model.mixers import on_cache_path
from sharedprefix.model.support import inline_mixer_reason

__all__ = [
    "SharedPrefixGRPOConfig",
    "SharedPrefixGRPOTrainer",
    "SharedPrefixHooks",
    "SharedPrefixRLOOConfig",
    "SharedPrefixRLOOTrainer",
    "SharedPrefixSettings",
    "membership_matters",
    "tree_rows",
]


@dataclass
class SharedPrefixGRPOConfig(GRPOConfig, SharedPrefixSettings):
    """``GRPOConfig`` plus the settings of sharedprefix (``SharedPrefixSettings``)."""


@dataclass
class SharedPrefixRLOOConfig(RLOOConfig, SharedPrefixSettings):
    """``RLOOConfig`` plus the settings of sharedprefix (``SharedPrefixSettings``)."""


def membership_matters(trainer) -> list[str]:
    """Why the rows each microbatch holds change what a TRL ``trainer`` trains to, one reason per entry; empty when
    any split of each generation batch into microbatches gives the same parameters (up to rounding).

    The rule, read from TRL 1.16's ``_prepare_inputs`` and ``_compute_loss`` (GRPOTrainer and RLOOTrainer):
    TRL generates a (local) generation batch of ``per_device_train_batch_size * steps_per_generation`` rows every
    ``steps_per_generation * num_iterations`` micro-steps, shuffles its rows and splits it into
    ``steps_per_generation`` equal microbatches, and micro-step s trains on microbatch ``s % steps_per_generation``;
    an optimizer step sums the gradients of ``gradient_accumulation_steps`` micro-steps. Advantages, reward
    scaling (``scale_rewards``, RLOO's ``normalize_advantages``), old-policy and reference log-probs are computed
    per row over the whole generation batch before the shuffle, so they do not depend on it. Membership matters
    exactly when ``steps_per_generation > 1`` and at least one of:

    - ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation``: some optimizer step sees only
      part of a generation batch, so which rows are trained before the parameters move depends on membership
      (``steps_per_generation > gradient_accumulation_steps``, TRL's usual multi-step setting, is one case);
    - the loss is not a sum over rows with constant weights, because a microbatch normaliser or statistic enters:
      GRPO's ``loss_type="bnpo"`` (divided by the microbatch's token count), GRPO's entropy bonus
      (``entropy_coef`` != 0 or ``use_adaptive_entropy``: the microbatch's mean entropy), GRPO's
      ``top_entropy_quantile`` < 1 (the entropy threshold is a quantile over the microbatch's tokens), and the MoE
      load-balancing loss of either trainer (``router_aux_loss_coef`` with a router: the microbatch's routing
      statistics).

    Every other setting is a sum over rows with weights fixed for the generation batch, so membership does not
    matter: ``loss_type`` "grpo", "sapo", "luspo" (per-row means over a microbatch of fixed size), "dr_grpo"
    (divided by rows x ``max_completion_length``), "dapo", "cispo", "vespo" (divided by the generation batch's
    token count), RLOO's per-sequence mean, ``importance_sampling_level``, ``epsilon``/``epsilon_high``,
    ``delta``, ``beta``, ``mask_truncated_completions``, ``off_policy_mask_threshold``, and ``num_iterations``
    (each pass reuses the same microbatches, each optimizer step still whole generation batches when the first
    rule does not apply).
    """
    a = trainer.args
    spg, ga = a.steps_per_generation or 1, a.gradient_accumulation_steps
    if spg <= 1:  # one microbatch per generation batch: every order holds the same rows
        return []
    reasons = []
    if ga % spg:
        reasons.append(
            f"gradient_accumulation_steps={ga} is not a multiple of steps_per_generation={spg}, so an optimizer step "
            "falls inside a generation batch and the rows trained before it depend on membership"
        )
    if getattr(trainer, "loss_type", None) == "bnpo":
        reasons.append("loss_type='bnpo' divides each microbatch's loss by that microbatch's token count")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        reasons.append("the entropy bonus (entropy_coef or use_adaptive_entropy) is each microbatch's mean entropy")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        reasons.append(
            f"top_entropy_quantile={trainer.top_entropy_quantile} takes its entropy threshold over each microbatch's "
            "tokens"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append("the MoE load-balancing loss (router_aux_loss_coef) is each microbatch's")
    return reasons


class SharedPrefixHooks:
    """The hooks a TRL trainer gets from sharedprefix, and the checks made when it is built; mixed in before the TRL
    trainer (``class SharedPrefixGRPOTrainer(SharedPrefixHooks, GRPOTrainer)``). It needs of that trainer the hook's
    signature and, under ``sharedprefix_group_microbatches`` only, the ``_prepare_inputs`` body of GRPOTrainer, which
    RLOOTrainer shares."""

    # whether TRL's loss backpropagates through the entropies (GRPOTrainer's entropy bonus); see _entropy_graph
    _sp_entropy_in_loss = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        self._sp_budget, self._sp_mode = checked_settings(self)
        self._sp_plans = PlanCache(capacity=plan_capacity(self))
        self._sp_step = StepState()
        self._sp_pending: list = []  # policy calls whose backward runs after TRL's (``trl_after``: FSDP2)
        self._refuse_at_construction()
        warn_if_padding_moves_logits(self, unwrap(self.model))
        reasons = membership_matters(self) if setting(a, "sharedprefix_group_microbatches") else []
        if reasons:
            warnings.warn(
                "sharedprefix_group_microbatches=True keeps whole groups inside one microbatch, so this trainer "
                f"trains to other parameters than TRL's {_trl_name(self)} here: " + "; ".join(reasons) + ". The "
                "same rows in another order, an equally valid sample, but not TRL's result. Set "
                "sharedprefix_group_microbatches=False (the default) for TRL's own microbatches.",
                UserWarning,
                stacklevel=2,
            )
        if getattr(a, "cast_lm_head_to_fp32", False):  # TRL cast the heads; sharedprefix runs them outside autocast
            for m in (self.model, getattr(self, "ref_model", None)):
                if m is not None:
                    mark_float32_head(unwrap(m))

    def _refuse_at_construction(self):
        """What the log-prob hook could not compute, refused now, each with the setting that removes it."""
        inner = unwrap(self.model)
        tp = getattr(inner, "_tp_size", None) or 1
        if tp > 1:
            trl_name = _trl_name(self)
            raise ValueError(
                f"the model is tensor-parallel (tp_size={tp}). sharedprefix's own calls are verified exact under "
                f"transformers' tensor parallelism, but TRL's {trl_name} with it needs accelerate's ParallelismConfig, "
                "which refuses CPU processes (DistributedType.MULTI_CPU), so this trainer has never been run against "
                f"{trl_name} with tensor parallelism. Load the model without tp_plan, or call sp.logprobs / "
                "sp.backward in your own loop (docs/distributed.md)."
            )
        hybrid = on_cache_path(inner)
        check_neftune(self)
        check_training_noise(self, inner, hybrid)  # check_supported in eval and in training mode
        check_reentrant_budget(self, self._sp_budget)
        self._sp_mode = check_fsdp(self, inner, hybrid, self._sp_mode)  # FSDP2: the policy backward after TRL's
        name = type(inner).__name__
        if hybrid and self.args.gradient_checkpointing:
            raise ValueError(
                f"{name} is a hybrid model (layers that mix tokens outside attention) and gradient_checkpointing=True "
                "(TRL's default): transformers turns the model's cache off under gradient checkpointing, and "
                "sharedprefix carries each prompt's convolution and recurrent state to its completions through that "
                "cache. Set gradient_checkpointing=False in the config (sharedprefix_max_tokens bounds the memory)."
                + inline_mixer_reason(getattr(inner.config, "model_type", None))
            )
        if not getattr(self, "aux_loss_enabled", False):
            return
        if hybrid or inner.config.get_text_config() is not inner.config:
            kind = "a hybrid model" if hybrid else "a vision-language model"
            raise ValueError(
                f"{name} is {kind} with an MoE load-balancing loss (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}): sharedprefix reproduces that loss on the text path only, where it "
                "reads each pass's router logits, so this trainer would train on another loss than TRL's. Set "
                "router_aux_loss_coef=0.0 in the config (routing itself stays exact)."
            )
        router.check_available(inner)  # the model's module has a load-balancing loss to reproduce

    # -- log-probs ---------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extra,
    ):
        images = check_image_inputs(extra)
        B, C = input_ids.shape[0], logits_to_keep
        state = getattr(self, "_sp_step", None)  # None on a stand-in that has only what the hook reads
        policy = torch.is_grad_enabled() and state is not None  # the policy's pass: TRL's only one with grad
        if policy and state.current is not None:  # a micro-step of a window: its step's microbatch
            got = (input_ids, attention_mask, logits_to_keep, *(extra.get(k) for k in MULTIMODAL))
            return self._step_logprobs(model, got, compute_entropy, bool(compute_aux_loss))
        grouped = images or on_cache_path(unwrap(model))  # the hybrid path takes groups of one prompt, not trees
        if grouped:
            used = {k: extra[k] for k in MULTIMODAL if extra.get(k) is not None}
            groups, members = image_groups(input_ids, attention_mask, logits_to_keep, **used)
            source = groups
        else:  # planned once per microbatch: the old-policy, reference and policy calls on it reuse the plan
            source, tr = self._sp_plans.lookup(
                model,
                (input_ids, attention_mask),
                (logits_to_keep,),
                lambda: ((t := tree_rows(input_ids, attention_mask, logits_to_keep)).tree, t),
                max_tokens=self._sp_budget,
            )
        dtype = _values_dtype(model)
        zeros = torch.zeros(B, C, dtype=dtype, device=input_ids.device)
        if not source:  # image or hybrid rows, every completion masked: a zero connected to the graph, as in TRL
            anchor = (
                sum(p.reshape(-1)[:1].sum() for p in model.parameters() if p.requires_grad)
                if torch.is_grad_enabled()
                else 0.0
            )
            zeros = zeros + 0.0 * anchor
            return zeros, (zeros.detach().clone() if compute_entropy else None), None
        # With a budget, the policy pass is deferred: values without a graph now, sp.backward under the
        # budget when TRL backpropagates its loss (exact by the chain rule). Gradient checkpointing defers too.
        # Where the engine refuses grad-enabled log-probs (FSDP2), sp.backward runs after TRL's backward (trl_after).
        after = policy and refusal_of(model) is not None
        defer = True if (torch.is_grad_enabled() and self._sp_budget is not None and not after) else None
        options = dict(max_tokens=self._sp_budget, prefix_activations=self._sp_mode, grad_reduction="mean")
        with self.accelerator.autocast(), torch.set_grad_enabled(torch.is_grad_enabled() and not after):
            out = sp.logprobs(
                model,
                source,
                temperature=self.temperature,
                entropy=compute_entropy,
                defer=defer,
                aux_loss=bool(compute_aux_loss) and not grouped,  # refused at construction where grouped
                **options,
            )  # TRL's losses are per-rank means, averaged as DDP does
        if after:
            out = hold(self, model, source, out, _entropy_in_loss(self), dict(options, temperature=self.temperature))
        log_plan(self, source)  # into TRL's own metrics: tokens computed against plain, passes, the mode, memory
        if policy and isinstance(source, sp.CallPlan):
            add_tokens(self, source.plan.tokens_computed, source.plan.plain_tokens)
        aux = out.aux_loss if compute_aux_loss else None  # TRL's: the loss of this microbatch's rows
        lp, ent = _hook_layout(out, members if grouped else tr, B, C, compute_entropy, dtype)
        return lp, _entropy_graph(self, ent), aux

    def _step_logprobs(self, model, got: tuple, compute_entropy, compute_aux_loss=False):
        """The policy log-probs of the micro-step running now, microbatch k of its window's step
        (``integrations.trl_step``), whose hook got ``got`` (input_ids, attention_mask, logits_to_keep, then the
        ``MULTIMODAL`` inputs): the shared prompts read from the step's cache; where the engine refuses grad-enabled
        log-probs (FSDP2) the values without grad, and ``sp.backward`` on the step's microbatch after TRL's backward
        (``trl_after``)."""
        held = None
        if refusal_of(model) is not None:
            opts = dict(temperature=self.temperature, grad_reduction="mean")
            held = lambda source, out: hold(self, model, source, out, _entropy_in_loss(self), opts)  # noqa: E731
        out, rows = step_logprobs(self, model, got, compute_entropy, held, aux=compute_aux_loss)
        lp, ent = _hook_layout(out, rows, got[0].shape[0], got[2], compute_entropy, _values_dtype(model))
        return lp, _entropy_graph(self, ent), out.aux_loss if compute_aux_loss else None

    # -- microbatches: TRL's, or whole groups under sharedprefix_group_microbatches --------------------------------

    def _prepare_inputs(self, generation_batch):
        """TRL's own ``_prepare_inputs`` (its row shuffle and split), unless ``sharedprefix_group_microbatches``:
        then TRL's body with its row shuffle replaced by ``_group_preserving_shuffle``. In training, the micro-step's
        window of its optimizer step is planned as one ``sp.plan_step`` step at its first micro-step
        (``integrations.trl_step``)."""
        if not getattr(self.args, "sharedprefix_group_microbatches", False):
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                self._begin_micro_step()
            return inputs
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = _group_preserving_shuffle(split_pixel_values_by_grid(batch))  # images: one entry per row
            batches = split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' fetch of one optimizer step's batches, before the first of its micro-steps: the next
        micro-step (TRL's ``_step``) starts the optimizer step (``trl_step.begin_update``). Read here, not inferred
        from the last synchronised micro-step, so that a second ``train()`` after one stopped inside an optimizer
        step starts its first optimizer step where transformers does."""
        out = super().get_batch_samples(epoch_iterator, num_batches, device)
        begin_update(self, self._step)
        return out

    def _begin_micro_step(self):
        """Micro-step ``self._step``: its window (the micro-steps of its optimizer step from its generation batch,
        ``window_of``) planned at the window's first micro-step, the accumulation boundary checked, the hook pointed
        at its microbatch (``trl_step.enter_micro_step``)."""
        state, t = self._sp_step, self._step
        if state.update_start is None or state.update_start > t:
            state.update_start = t
        size = getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps
        micro = window_of(t, state.update_start, size, self.args.steps_per_generation, self.num_iterations)
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        enter_micro_step(self, model, t, micro, state.update_start + size - 1, lambda: plan_window(self, model, micro))

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's micro-step, checked and logged by ``trl_step.run_micro_step``; the policy passes whose backward runs
        after TRL's (``trl_after``: FSDP2) run it at its end."""
        trl_step = super().training_step

        def run():
            self._sp_pending = []
            try:
                out = trl_step(model, inputs, num_items_in_batch)
                backward_pending(self)
                return out
            finally:
                self._sp_pending = []

        return run_micro_step(self, self._step, run)


class SharedPrefixGRPOTrainer(SharedPrefixHooks, GRPOTrainer):
    """``GRPOTrainer`` whose log-probs compute each prompt once per pass; same constructor, same results (with the
    default ``sharedprefix_group_microbatches=False``). TRL's own ``GRPOConfig`` is accepted: our settings at their
    defaults."""


class SharedPrefixRLOOTrainer(SharedPrefixHooks, RLOOTrainer):
    """``RLOOTrainer`` whose log-probs compute each prompt once per pass; same constructor, same results (with the
    default ``sharedprefix_group_microbatches=False``); TRL's own ``RLOOConfig`` is accepted. RLOO's loss reads
    the entropies as a metric only, so they are returned without a graph."""

    _sp_entropy_in_loss = False


def _trl_name(trainer) -> str:
    """The name of the TRL trainer class ``trainer`` extends (``GRPOTrainer``, ``RLOOTrainer``)."""
    return next(c.__name__ for c in type(trainer).__mro__ if c.__module__.startswith("trl."))


def _entropy_in_loss(trainer) -> bool:
    """Whether TRL's loss backpropagates through the entropies (GRPOTrainer's entropy bonus, static or adaptive)."""
    return getattr(trainer, "_sp_entropy_in_loss", True) and getattr(trainer, "_entropy_bonus_enabled", True)


def _values_dtype(model) -> torch.dtype:
    """The dtype of the hook's log-probs: float64 for a float64 model, else float32 (as sharedprefix returns them)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def _hook_layout(out, rows, B: int, C: int, entropy: bool, dtype: torch.dtype):
    """``out``'s log-probs and entropies (None without ``entropy``) in TRL's (B, C) completion columns: from a tree's
    rows (``TreeRows``: ``to_rows``) or from image groups (their members: ``from_groups``; (N, T) in group order,
    T <= C, completion columns from 0 in TRL's layout too)."""
    if isinstance(rows, TreeRows):
        return to_rows(out.logprobs, rows, B, C), (to_rows(out.entropy, rows, B, C) if entropy else None)
    lp = from_groups(out.logprobs, rows, B, C, dtype)
    return lp, (from_groups(out.entropy, rows, B, C, dtype) if entropy else None)


def _entropy_graph(trainer, ent):
    """Entropies keep their graph only when a loss uses them (``_entropy_in_loss``); else they are detached, so the
    entropy branch of the graph is freed at once and its backward never runs."""
    if ent is None or _entropy_in_loss(trainer):
        return ent
    return ent.detach()


def _group_preserving_shuffle(batch: dict) -> dict:
    """Shuffle the order of groups (rows with the same prompt and images), not of rows, with the permutation TRL
    would draw for rows."""
    n = len(next(v for v in batch.values() if v is not None))
    perm = torch.randperm(n)  # the same draw as trl's shuffle_sequence_dict, so RNG streams stay aligned
    prompt_ids, prompt_mask = batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu().bool()
    pix = batch.get("pixel_values")  # after split_pixel_values_by_grid: a list, row i's images at i
    keys = [
        (
            tuple(prompt_ids[i][prompt_mask[i]].tolist()),
            pix[i].detach().cpu().numpy().tobytes() if isinstance(pix, list) else None,
        )
        for i in range(n)
    ]
    members: dict[tuple, list[int]] = {}
    for i in range(n):
        members.setdefault(keys[i], []).append(i)
    order, seen = [], set()
    for i in perm.tolist():
        if keys[i] not in seen:
            seen.add(keys[i])
            order.extend(members[keys[i]])
    idx = torch.tensor(order)

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[idx.to(v.device)]
        return [v[i] for i in order]

    return {k: permute(v) for k, v in batch.items()}


def __getattr__(name: str):
    """``SharedPrefixAsyncGRPOTrainer`` and ``SharedPrefixAsyncGRPOConfig`` (``integrations.trl_async``), imported on
    first use, so that this module does not import TRL's experimental asynchronous trainer."""
    if name in ("SharedPrefixAsyncGRPOConfig", "SharedPrefixAsyncGRPOTrainer"):
        from sharedprefix.integrations import trl_async

        return getattr(trl_async, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
