"""The policy passes of one optimizer step as one ``sp.plan_step`` step, for the TRL trainers (the synchronous ones,
``integrations.trl``, and the asynchronous one, ``integrations.trl_async``): each prompt computed once per optimizer
step, TRL's own microbatches kept. The window, its plan (``make_window``), the hooks' step call (``step_logprobs``)
and the checks around a micro-step (``enter_micro_step``, ``run_micro_step``) are shared; each trainer says which
micro-steps form a window and how its microbatches' rows are read.

TRL 1.16 (``GRPOTrainer``, ``RLOOTrainer``): ``training_step`` runs ``_prepare_inputs`` and the loss, then increments
``_step`` (micro-steps, counted from 0 over the whole run); ``_prepare_inputs`` regenerates every ``steps_per_generation
* num_iterations`` micro-steps and returns ``_buffered_inputs[_step % steps_per_generation]``. transformers' Trainer
fetches an optimizer step's micro-steps together and sets ``current_gradient_accumulation_steps`` to their number (fewer
than ``gradient_accumulation_steps`` at an epoch's end) and ``accelerator.sync_gradients`` True at its last.

A *window* is the micro-steps of one optimizer step that come from one generation batch: ``[max(update start,
generation start), min(update end, generation end))``; the update's start is the micro-step after transformers
fetched the optimizer step's batches (``begin_update``, from ``get_batch_samples``; ``StepState.update_start``). A
window of two or more micro-steps is planned as one step at its first micro-step, from the buffered microbatches'
rows as TRL's ``_compute_loss`` builds them (``tree_rows``; with images, ``image_groups``); each of its micro-steps'
policy pass is ``sp.logprobs(model, step.microbatch(k))`` (``step_logprobs``; the shared prompts' backward runs inside
the window's last micro-step's backward). With ``num_iterations`` > 1 and ``gradient_accumulation_steps`` >
``steps_per_generation`` one buffered microbatch appears twice in a window: two microbatches of the step with the same
rows, as in TRL's two micro-steps.

Checked, each a ``RuntimeError`` rather than a wrong gradient: the hook's rows equal the planned microbatch's
(``check_rows``), ``accelerator.sync_gradients`` is True at the update's last micro-step and nowhere else inside a
window, and the step finished at the window's last micro-step. Where a step cannot run (``off_reason``) the trainer
calls the hook per microbatch, as with ``sharedprefix_step=False``, and logs why once.

The asynchronous trainer (TRL 1.16's ``AsyncGRPOTrainer``) has no generation batches: every micro-step trains samples
of its own, fetched with the rest of its optimizer step by transformers' ``get_batch_samples`` before the first runs,
so its window is the whole optimizer step (``trl_async``).

Notation: K = micro-steps of a window, B = rows of a microbatch, C = completion columns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import sharedprefix as sp
from sharedprefix.integrations.trl_batch import MULTIMODAL, check_image_inputs, image_groups, tree_rows
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import uses_checkpointing, uses_reentrant_checkpointing
from sharedprefix.parallel.detect import detect
from sharedprefix.schedule.results import PREFIX_MODES
from sharedprefix.schedule.step_graph import keeps_graph
from sharedprefix.schedule.step_make import refuse_engine

logger = logging.getLogger(__name__)

__all__ = [
    "StepState",
    "Window",
    "add_tokens",
    "begin_update",
    "check_rows",
    "enter_micro_step",
    "make_window",
    "off_reason",
    "plan_window",
    "run_micro_step",
    "step_logprobs",
    "window_of",
]


def window_of(t: int, update_start: int, update_size: int, steps_per_generation: int, num_iterations: int) -> range:
    """The micro-steps of micro-step ``t``'s window: those of its optimizer step (``update_size`` micro-steps from
    ``update_start``) that come from its generation batch (every ``steps_per_generation * num_iterations``
    micro-steps, from 0)."""
    every = steps_per_generation * num_iterations
    gen_start = t - t % every
    return range(max(update_start, gen_start), min(update_start + update_size, gen_start + every))


@dataclass
class Window:
    """One window's step: ``micro_steps`` (the trainer's micro-step numbers), ``step`` (``sp.Step``, or an
    ``sp.SplitStep`` under ``sharedprefix_step_cached_tokens``; one microbatch per micro-step), per microbatch its
    hook's ``inputs`` (what the policy pass is called with, tensors, ints or None: input_ids (B, L), attention_mask
    (B, L), logits_to_keep and the ``MULTIMODAL`` inputs for the synchronous trainers; the packed row and its tree
    tensors for the asynchronous one; for ``check_rows``) and its ``rows`` (how its rows map back onto the hook's
    layout: ``TreeRows`` for ``to_rows``, image groups' members for ``from_groups``, ``PackedTree`` for
    ``to_packed``); token counts from the plan: ``shared[k]`` (the shared segments of microbatch k's step or part,
    computed once by its first call), ``own[k]`` (microbatch k's own passes), ``plain[k]`` (a plain per-row forward
    of its rows)."""

    micro_steps: range
    step: sp.Step
    inputs: list[tuple]
    rows: list[Any]
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
    if getattr(trainer, "aux_loss_enabled", False) and (why := detect(model, inner).step_aux_refusal):
        return f"the MoE load-balancing loss (router_aux_loss_coef) under {why}"
    if uses_reentrant_checkpointing(inner):
        return (
            "gradient checkpointing with use_reentrant=True: a step's microbatches read their prompts' cached K/V, "
            "which reentrant checkpointing gives no gradient"
        )
    try:
        refuse_engine(model)  # FSDP2 and DeepSpeed where they cannot, tensor parallelism, cache-path hybrids
    except ValueError as e:
        return str(e)
    return ""


def plan_window(trainer, model, micro_steps: range) -> Window | None:
    """The step of ``micro_steps`` on ``model``, planned from ``trainer._buffered_inputs`` (the synchronous trainers)
    as TRL's ``_compute_loss`` calls the hook on them: text rows as trees; where a microbatch holds images, every
    microbatch's rows as ``image_groups`` (rows with the same prompt and images one group, so each image prompt and
    its vision tower run once for the step). None where a microbatch has no completion token at all (planned per
    microbatch: a step's microbatch needs rows)."""
    spg = trainer.args.steps_per_generation
    batches = [trainer._buffered_inputs[u % spg] for u in micro_steps]
    images = any(check_image_inputs({k: mb.get(k) for k in MULTIMODAL}) for mb in batches)
    inputs, rows, sources = [], [], []
    for mb in batches:
        prompt_ids, completion_ids = mb["prompt_ids"], mb["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # as TRL's _compute_loss builds them
        attention_mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        logits_to_keep = completion_ids.size(1)
        extra = [mb.get(k) for k in MULTIMODAL]
        inputs.append((input_ids, attention_mask, logits_to_keep, *extra))
        if images:
            used = {k: v for k, v in zip(MULTIMODAL, extra) if v is not None}
            groups, members = image_groups(input_ids, attention_mask, logits_to_keep, **used)
            if not groups:
                return None
            rows.append(members)
            sources.append(groups)
        else:
            rows.append(tree_rows(input_ids, attention_mask, logits_to_keep))
            sources.append(rows[-1].tree)
    return make_window(trainer, model, micro_steps, inputs, rows, sources)


def make_window(trainer, model, micro_steps: range, inputs: list[tuple], rows: list, sources: list) -> Window:
    """The ``Window`` of ``micro_steps`` on ``model``: ``sources`` (one per micro-step: a tree, or a list of groups)
    planned as one ``sp.plan_step`` step under the trainer's settings; ``inputs`` and ``rows`` as ``Window`` keeps
    them."""
    step = sp.plan_step(
        model,
        sources,
        max_tokens=trainer._sp_budget,
        prefix_activations=trainer._sp_mode,
        max_cached_tokens=getattr(trainer.args, "sharedprefix_step_cached_tokens", None),
        aux_loss=bool(getattr(trainer, "aux_loss_enabled", False)),  # the step caches its prompts' router logits
    )
    shared, own, plain = [], [], []
    for k in range(len(micro_steps)):
        part, kk = step.part_of(k)  # a step bounded by sharedprefix_step_cached_tokens may run in parts
        mine = part.splan.microbatch_plan(kk)
        shared.append(part.splan.shared_tokens)
        own.append(mine.tokens_computed)
        plain.append(mine.plain_tokens)
    return Window(micro_steps, step, inputs, rows, shared, own, plain)


def check_rows(window: Window, k: int, got: tuple) -> None:
    """Raise unless the hook's inputs ``got`` are microbatch ``k``'s of ``window`` (what its step planned)."""
    want = window.inputs[k]
    if len(got) != len(want) or not all(_same(a, b) for a, b in zip(want, got)):
        raise RuntimeError(
            f"the policy log-prob hook got rows ({_shapes(got)}) other than those of micro-step "
            f"{window.micro_steps.start + k}'s microbatch, which its optimizer step planned from TRL's inputs "
            f"({_shapes(want)}). This is a bug of sharedprefix's TRL trainer (or a subclass that changes TRL's "
            "inputs before its loss); set sharedprefix_step=False to run each microbatch on its own."
        )


def _same(want, got) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and want.shape == got.shape and torch.equal(want, got.to(want.device))
    return want == got


def _shapes(values: tuple) -> str:
    return ", ".join(str(tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in values)


def begin_update(trainer, t: int) -> None:
    """transformers fetched an optimizer step's batches (``get_batch_samples``, before the first of its micro-steps):
    micro-step ``t`` starts it. A window still open here was left by an optimizer step that never reached its last
    micro-step (training stopped inside it, or a micro-step raised), whose gradients the next ``train()`` zeroes
    (``model.zero_grad()``) as it does TRL's: its step is released, its prompts' share dropped, and its tokens not
    logged, so that the model's next step is not refused as following an unfinished one."""
    state: StepState = trainer._sp_step
    if state.window is not None:
        state.window.step.release()
        state.window = None
    state.current = None
    state.tokens = [0.0, 0.0]
    state.update_start = t


def enter_micro_step(trainer, model, t: int, micro: range, last: int, plan: Callable[[], Window | None]) -> None:
    """Micro-step ``t`` of window ``micro`` (micro-step numbers) on ``model`` (the trainer's wrapped model), in the
    optimizer step from ``state.update_start`` to ``last``: at the window's first micro-step its step is planned
    (``plan()``; not where steps are off, ``off_reason``, logged once), then the accumulation boundary is checked and
    the hook pointed at its microbatch (``state.current``). A window of one micro-step runs per microbatch."""
    state: StepState = trainer._sp_step
    state.current = None
    if len(micro) < 2:
        return
    if t == micro.start:
        state.window = None
        if state.off is None:
            state.off = off_reason(trainer, model)
            log_off_once(trainer, state.off)
        if state.off:
            return
        state.window = plan()
    w = state.window
    if w is None or w.micro_steps != micro:
        return
    if bool(trainer.accelerator.sync_gradients) != (t == last):
        raise RuntimeError(
            f"micro-step {t} runs with accelerator.sync_gradients={trainer.accelerator.sync_gradients}, but the "
            f"optimizer step it belongs to ends at micro-step {last} (started at {state.update_start}): the "
            f"accumulation boundary is not where sharedprefix planned its step over micro-steps {list(micro)}, so the "
            "step's shared prompts could miss the optimizer step. Set sharedprefix_step=False (each microbatch on its "
            "own) and report this setting."
        )
    state.current = w.k(t)


def run_micro_step(trainer, t: int, run: Callable[[], Any]) -> Any:
    """``run()`` (TRL's micro-step ``t``); after it, a window's step must have finished at the window's last
    micro-step, and at an optimizer step's last micro-step its policy tokens are logged (``flush_tokens``) and the
    next optimizer step starts at ``t + 1``."""
    state: StepState = trainer._sp_step
    try:
        out = run()
    finally:
        state.current = None
    w = state.window
    if w is not None and t == w.micro_steps[-1]:
        state.window = None
        if w.step.state != "finished":
            raise RuntimeError(
                f"the step over micro-steps {list(w.micro_steps)} did not finish at its last micro-step (state "
                f"{w.step.state!r}, microbatches {w.step.missing} never ran their backward): TRL's loss did not "
                "backpropagate through their log-probs. Set sharedprefix_step=False."
            )
    if trainer.accelerator.sync_gradients:
        state.update_start = t + 1
        flush_tokens(trainer)
    return out


def step_logprobs(trainer, model, got: tuple, entropy: bool, held: Callable | None = None, aux: bool = False):
    """The policy pass of the micro-step running now, microbatch ``state.current`` of its window's step, whose hook
    was called with ``got`` (checked against the plan): ``sp.logprobs`` on the step's microbatch (the graph kept where
    TRL's backward can run it: one process without checkpointing; else deferred), logged (``log_call``). Returns its
    result, (n_k, W_k) aligned with the microbatch's tree rows, and the microbatch's ``rows`` mapping. ``held``: where
    the engine refuses grad-enabled log-probs, ``held(microbatch, values)`` of the values computed without grad
    (``trl_after.hold``: their backward runs after TRL's). ``aux``: the result carries the microbatch's MoE
    load-balancing loss (TRL's ``compute_aux_loss``; the step was planned with it, ``make_window``)."""
    state: StepState = trainer._sp_step
    w, k = state.window, state.current
    assert w is not None and k is not None  # the caller checked state.current
    inner = unwrap(model)
    if inner is not w.step.inner():  # (a SplitStep's parts share one model)
        raise RuntimeError(
            f"the log-prob hook ran with grad enabled on {type(inner).__name__}, not the policy model the "
            "micro-step's step was planned on; TRL computes only the policy's log-probs with grad. Set "
            "sharedprefix_step=False to run each microbatch on its own."
        )
    check_rows(w, k, got)
    part, kk = w.step.part_of(k)
    first = not part.recorded  # this call records the step's (or its part's) shared segments
    # one process without checkpointing: the graph kept (TRL backpropagates with loss.backward()), no second
    # forward; else deferred (DDP synchronises, checkpointing recomputes inside sharedprefix's backward, DeepSpeed
    # delivers through its engine.backward)
    engine = detect(model, inner)
    graph = keeps_graph(part, kk) and not engine.must_defer and engine.step_graph_refusal is None
    graph = graph and not uses_checkpointing(inner) and held is None
    with trainer.accelerator.autocast(), torch.set_grad_enabled(held is None):  # as TRL's own forward
        out = sp.logprobs(
            model,
            w.step.microbatch(k),
            temperature=trainer.temperature,
            entropy=entropy,
            grad_reduction="mean",
            aux_loss=aux,
            **({"defer": False} if graph else {}),
        )  # TRL's losses are per-rank means, averaged as DDP does
    if held is not None:
        out = held(w.step.microbatch(k), out)
    log_call(trainer, w, k, first)
    return out, w.rows[k]


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
