"""The policy passes of one optimizer step as one ``sp.plan_step`` step, for the synchronous TRL trainers
(``integrations.trl``): each prompt computed once per optimizer step, TRL's own microbatches kept.

TRL 1.16 (``GRPOTrainer``, ``RLOOTrainer``): ``training_step`` runs ``_prepare_inputs`` and the loss, then increments
``_step`` (micro-steps, counted from 0 over the whole run); ``_prepare_inputs`` regenerates every ``steps_per_generation
* num_iterations`` micro-steps and returns ``_buffered_inputs[_step % steps_per_generation]``. transformers' Trainer
fetches an optimizer step's micro-steps together and sets ``current_gradient_accumulation_steps`` to their number (fewer
than ``gradient_accumulation_steps`` at an epoch's end) and ``accelerator.sync_gradients`` True at its last.

A *window* is the micro-steps of one optimizer step that come from one generation batch: ``[max(update start,
generation start), min(update end, generation end))``; the update's start is where the last synchronised micro-step
left off (``StepState.update_start``). A window of two or more micro-steps is planned as one step at its first
micro-step, from the buffered microbatches' rows as TRL's ``_compute_loss`` builds them (``tree_rows``); each of its
micro-steps' policy pass is ``sp.logprobs(model, step.microbatch(k))`` (deferred; the shared prompts' backward runs
inside the window's last micro-step's backward). With ``num_iterations`` > 1 and ``gradient_accumulation_steps`` >
``steps_per_generation`` one buffered microbatch appears twice in a window: two microbatches of the step with the same
rows, as in TRL's two micro-steps.

Checked, each a ``RuntimeError`` rather than a wrong gradient: the hook's rows equal the planned microbatch's
(``check_rows``), ``accelerator.sync_gradients`` is True at the update's last micro-step and nowhere else inside a
window, and the step finished at the window's last micro-step. Where a step cannot run (``off_reason``) the trainer
calls the hook per microbatch, as with ``sharedprefix_step=False``, and logs why once.

Notation: K = micro-steps of a window, B = rows of a microbatch, C = completion columns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

import sharedprefix as sp
from sharedprefix.integrations.trl_batch import MULTIMODAL, TreeRows, tree_rows
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import uses_reentrant_checkpointing
from sharedprefix.schedule.results import PREFIX_MODES
from sharedprefix.schedule.step_make import refuse_engine

logger = logging.getLogger(__name__)

__all__ = ["StepState", "Window", "check_rows", "off_reason", "window_of"]


def window_of(t: int, update_start: int, update_size: int, steps_per_generation: int, num_iterations: int) -> range:
    """The micro-steps of micro-step ``t``'s window: those of its optimizer step (``update_size`` micro-steps from
    ``update_start``) that come from its generation batch (every ``steps_per_generation * num_iterations``
    micro-steps, from 0)."""
    every = steps_per_generation * num_iterations
    gen_start = t - t % every
    return range(max(update_start, gen_start), min(update_start + update_size, gen_start + every))


@dataclass
class Window:
    """One window's step: ``micro_steps`` (TRL's ``_step`` values), ``step`` (``sp.Step``, or an ``sp.SplitStep``
    under ``sharedprefix_step_cached_tokens``; one microbatch per micro-step), per microbatch its hook ``inputs``
    (input_ids (B, L), attention_mask (B, L), logits_to_keep) and its ``rows`` (``TreeRows``, for ``to_rows``); token
    counts from the plan: ``shared[k]`` (the shared segments of microbatch k's step or part, computed once by its first
    call), ``own[k]`` (microbatch k's own passes), ``plain[k]`` (a plain per-row forward of its rows)."""

    micro_steps: range
    step: sp.Step
    inputs: list[tuple[torch.Tensor, torch.Tensor, int]]
    rows: list[TreeRows]
    shared: list[int]
    own: list[int]
    plain: list[int]

    def k(self, t: int) -> int:
        return t - self.micro_steps.start


@dataclass
class StepState:
    """A trainer's step bookkeeping: ``update_start`` (the first micro-step of the optimizer step under way),
    ``window`` (the current window's step, or None), ``current`` (the microbatch index the micro-step running now has
    in ``window``, or None: the hook runs per microbatch), ``off`` (why steps are off, once decided; "" while on),
    ``tokens``: the policy passes' [computed, plain] tokens of the optimizer step under way."""

    update_start: int | None = None
    window: Window | None = None
    current: int | None = None
    off: str | None = None
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])


def off_reason(trainer, model) -> str:
    """Why ``trainer``'s optimizer steps run their policy passes per microbatch instead of as one step on ``model``
    (the trainer's wrapped model), in words; "" where steps are used. Read once, at the first window."""
    a = trainer.args
    if not getattr(a, "sharedprefix_step", True):
        return "sharedprefix_step=False"
    if getattr(a, "sharedprefix_group_microbatches", False):
        return "sharedprefix_group_microbatches=True (whole groups per microbatch, planned per microbatch)"
    inner = unwrap(model)
    if inner.config.get_text_config() is not inner.config:
        return (
            f"{type(inner).__name__} is a vision-language model: image rows are regrouped by prompt and image into "
            "groups per microbatch"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE load-balancing loss (router_aux_loss_coef) is each microbatch's own"
    if uses_reentrant_checkpointing(inner):
        return (
            "gradient checkpointing with use_reentrant=True: a step's microbatches read their prompts' cached K/V, "
            "which reentrant checkpointing gives no gradient"
        )
    try:
        refuse_engine(model)  # FSDP2, DeepSpeed, tensor parallelism, cache-path hybrids, the MoE aux loss
    except ValueError as e:
        return str(e)
    return ""


def plan_window(trainer, model, micro_steps: range) -> Window | None:
    """The step of ``micro_steps`` on ``model``, planned from ``trainer._buffered_inputs``; None where a microbatch
    holds images (planned per microbatch)."""
    spg = trainer.args.steps_per_generation
    inputs, rows = [], []
    for u in micro_steps:
        mb = trainer._buffered_inputs[u % spg]
        if any(mb.get(name) is not None for name in MULTIMODAL):
            return None
        prompt_ids, completion_ids = mb["prompt_ids"], mb["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # as TRL's _compute_loss builds them
        attention_mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        logits_to_keep = completion_ids.size(1)
        inputs.append((input_ids, attention_mask, logits_to_keep))
        rows.append(tree_rows(input_ids, attention_mask, logits_to_keep))
    step = sp.plan_step(
        model,
        [r.tree for r in rows],
        max_tokens=trainer._sp_budget,
        prefix_activations=trainer._sp_mode,
        max_cached_tokens=getattr(trainer.args, "sharedprefix_step_cached_tokens", None),
    )
    shared, own, plain = [], [], []
    for k in range(len(micro_steps)):
        part, kk = step.part_of(k)  # a step bounded by sharedprefix_step_cached_tokens may run in parts
        mine = part.splan.microbatch_plan(kk)
        shared.append(part.splan.shared_tokens)
        own.append(mine.tokens_computed)
        plain.append(mine.plain_tokens)
    return Window(micro_steps, step, inputs, rows, shared, own, plain)


def check_rows(window: Window, k: int, input_ids, attention_mask, logits_to_keep) -> None:
    """Raise unless the hook's rows are microbatch ``k``'s of ``window`` (what its step planned)."""
    ids, mask, keep = window.inputs[k]
    same = (
        keep == logits_to_keep
        and ids.shape == input_ids.shape
        and torch.equal(ids, input_ids.to(ids.device))
        and torch.equal(mask, attention_mask.to(mask.device))
    )
    if not same:
        raise RuntimeError(
            f"the policy log-prob hook got rows (input_ids {tuple(input_ids.shape)}, logits_to_keep={logits_to_keep}) "
            f"other than those of micro-step {window.micro_steps.start + k}'s microbatch, which its optimizer step "
            f"planned from TRL's buffered inputs (input_ids {tuple(ids.shape)}, logits_to_keep={keep}). This is a bug "
            "of sharedprefix's TRL trainer (or a subclass that changes TRL's inputs in _compute_loss); set "
            "sharedprefix_step=False to run each microbatch on its own."
        )


def log_call(trainer, window: Window, k: int, first: bool) -> None:
    """Microbatch ``k``'s policy call into TRL's metrics, as ``log_plan`` logs a call (the shared segments' tokens on
    the window's first call), and into the optimizer step's token counts."""
    computed = window.own[k] + (window.shared[k] if first else 0)
    metrics = trainer._metrics["train"]
    metrics["sharedprefix/tokens_computed"].append(float(computed))
    metrics["sharedprefix/tokens_plain"].append(float(window.plain[k]))
    part, kk = window.step.part_of(k)
    passes = len(part.splan.microbatch_plan(kk).passes) + first * len(part.splan.record)
    metrics["sharedprefix/passes"].append(float(passes))
    metrics["sharedprefix/prefix_mode"].append(float(PREFIX_MODES.index(trainer._sp_mode)))
    add_tokens(trainer, computed, window.plain[k])


def add_tokens(trainer, computed: float, plain: float) -> None:
    """Add a policy call's tokens to the optimizer step under way."""
    state: StepState = trainer._sp_step
    state.tokens[0] += computed
    state.tokens[1] += plain


def flush_tokens(trainer) -> None:
    """At an optimizer step's last micro-step: its policy tokens into TRL's metrics (``sharedprefix/step_tokens_*``,
    one entry per optimizer step, so TRL's average over a logging period is per optimizer step)."""
    state: StepState = trainer._sp_step
    if state.tokens[1]:
        metrics = trainer._metrics["train"]
        metrics["sharedprefix/step_tokens_computed"].append(state.tokens[0])
        metrics["sharedprefix/step_tokens_plain"].append(state.tokens[1])
    state.tokens = [0.0, 0.0]


def log_off_once(trainer, reason: str) -> None:
    if reason and reason != "sharedprefix_step=False":
        logger.warning(
            "%s runs each microbatch's policy pass on its own (each prompt once per microbatch, not once per "
            "optimizer step): %s.",
            type(trainer).__name__,
            reason,
        )
